"""Perplexity, KL divergence and top-1 agreement: the project's one definition of each.

Tokenize the whole text once; window i covers tokens [i*ctx, (i+1)*ctx); each window is run on its
own (no context carried over) and its tokens 1..ctx-1 are scored. Perplexity is exp of the mean
negative log-likelihood over all scored tokens. Against a reference model on the same windows:
KL is the mean over scored positions of KL(P_ref || P_model) in nats, and top-1 agreement the
fraction of positions where both models' most likely next token is the same.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from collections.abc import Callable, Iterable, Iterator

import torch

from llmopt.errors import InputError
from llmopt.model.decoder import Decoder
from llmopt.options import EvalOptions


def token_windows(ids: list[int], ctx: int, windows: int) -> torch.Tensor:
    """The first `windows` non-overlapping windows of `ctx` tokens ([windows, ctx]); 0 = all."""
    EvalOptions.of(ctx=ctx, windows=windows)  # their ranges, as `eval` declares them
    available = len(ids) // ctx
    windows = windows or available
    if available < windows or available == 0:
        raise InputError(f"the text has {len(ids)} tokens: {available} window(s) of {ctx}, fewer than the {windows} asked for")
    return torch.tensor(ids[: windows * ctx]).view(windows, ctx)


@dataclass
class EvalResult:
    windows: int
    ctx: int
    tokens_scored: int
    nll: float  # mean negative log-likelihood, nats per token
    perplexity: float
    ref_perplexity: float | None = None
    kl_divergence: float | None = None  # mean KL(ref || model), nats
    top1_agreement: float | None = None  # fraction in [0, 1]

    @property
    def ppl_increase_pct(self) -> float | None:
        if self.ref_perplexity is None:
            return None
        return 100.0 * (self.perplexity / self.ref_perplexity - 1.0)

    def to_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if v is not None}
        if self.ppl_increase_pct is not None:
            d["ppl_increase_pct"] = self.ppl_increase_pct
        return d


@torch.inference_mode()
def window_log_probs(model: Decoder, window: torch.Tensor) -> torch.Tensor:
    """log P(next token) at positions 0..ctx-2 of one window: [ctx-1, V] float32."""
    return next(batch_log_probs(model, window[None]))


def batch_log_probs(model: Decoder, windows: torch.Tensor) -> Iterator[torch.Tensor]:
    """`window_log_probs` of each of `windows` [n, ctx], from one forward of the blocks over all n.
    The LM head and softmax run one window at a time, so only one window's [ctx-1, V] logits exist
    at once (a batch of 8 x 512 tokens would otherwise hold 0.8 GB of them for SmolLM2)."""
    device = next(model.parameters()).device
    with torch.inference_mode():
        hidden = model.hidden(windows.to(device))
    yield from head_log_probs(model.lm_head, hidden)


def head_log_probs(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor) -> Iterator[torch.Tensor]:
    """`log_probs` of each window's final hidden states in `hidden` [n, ctx, hidden], one at a time."""
    for h in hidden:
        yield log_probs(head, h)


@torch.inference_mode()
def final_hidden_states(model: Decoder, windows: torch.Tensor, batch: int = 1) -> torch.Tensor:
    """The final-norm hidden states of every window [n, ctx, hidden], `batch` windows per forward: kept for a
    reference that several models are scored against, so its blocks run once (its head once per model)."""
    device = next(model.parameters()).device
    return torch.cat([model.hidden(windows[first:first + batch].to(device))
                      for first in range(0, windows.shape[0], batch)])


@torch.inference_mode()
def log_probs(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
    """log P(next token) at positions 0..ctx-2 of one window from its final hidden states [ctx, hidden]
    and an LM head (a module, or the streamed path's head read in slabs): [ctx-1, V] float32."""
    return torch.log_softmax(head(hidden[:-1]).float(), dim=-1)


def in_batches(model: Decoder, windows: torch.Tensor, batch: int) -> Iterator[torch.Tensor]:
    """`window_log_probs` of each window, `batch` windows per forward of the blocks."""
    for first in range(0, windows.shape[0], batch):
        yield from batch_log_probs(model, windows[first:first + batch])


@torch.inference_mode()
def evaluate(model: Decoder, windows: torch.Tensor, ref: Decoder | None = None,
             on_window: Callable[[int], None] | None = None, batch: int = 1) -> EvalResult:
    """Score `model` (and `ref`, when given) on each window; see the module docstring. `batch`
    windows share each forward (faster where one window leaves the device idle); the numbers are
    the unbatched ones up to float rounding (tested)."""
    check_batch(batch)
    refs = in_batches(ref, windows, batch) if ref is not None else None
    return score(windows, in_batches(model, windows, batch), refs, on_window)


@torch.inference_mode()
def score(windows: torch.Tensor, model_log_probs: Iterable[torch.Tensor], ref_log_probs: Iterable[torch.Tensor] | None = None,
          on_window: Callable[[int], None] | None = None) -> EvalResult:  # fmt: skip
    """The metrics of the module docstring from each window's log-probabilities [ctx-1, V] (the
    model's, and the reference's when given), in window order: the one place they are summed,
    whichever way the log-probabilities were computed (a loaded model, or eval/streamed.py)."""
    nll = ref_nll = kl = agree = 0.0
    refs = iter(ref_log_probs) if ref_log_probs is not None else None
    for i, logp in enumerate(model_log_probs):
        targets = windows[i, 1:, None].to(logp.device)
        nll -= logp.gather(-1, targets).sum().item()
        if refs is not None:
            ref_logp = next(refs).to(logp.device)
            ref_nll -= ref_logp.gather(-1, targets).sum().item()
            kl += (ref_logp.exp() * (ref_logp - logp)).sum().item()
            agree += (ref_logp.argmax(-1) == logp.argmax(-1)).sum().item()
        if on_window:
            on_window(i)
    n = windows.shape[0] * (windows.shape[1] - 1)
    result = EvalResult(windows=windows.shape[0], ctx=windows.shape[1], tokens_scored=n, nll=nll / n,
                        perplexity=math.exp(nll / n))
    if refs is not None:
        result.ref_perplexity = math.exp(ref_nll / n)
        result.kl_divergence = kl / n
        result.top1_agreement = agree / n
    return result


def check_batch(batch: int) -> None:
    """`--batch`: windows per forward, checked as `eval`'s option is declared (llmopt/options.py)."""
    EvalOptions.of(batch=batch)
