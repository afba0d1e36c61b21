"""Which layers a self-speculative draft skips: a short greedy search on the prompt's own text.

The goal is tokens per unit of time, not acceptance alone: skipping a layer makes every draft token
cheaper and fewer of them accepted. The search measures both on this machine and this text:

- cost: one full decode step (T), the LM head alone (H) and one verification forward of K+1 tokens
  (V) are timed once; a draft token that runs `kept` of the L layers costs H + kept/L * (T - H)
  (the layers have equal shapes, so the layers run are the cost model).
- acceptance: the prompt is prefilled into a cache of its own, and the full model's distributions
  p over its last `window` positions are kept. A candidate skip set then runs over that window
  on top of the full model's K/V of everything before it, giving q at each position; the
  acceptance per drafted token is the rejection rule's, sum(min(p, q)) (for greedy: whether the
  argmaxes agree), with the sampling filters but not the repetition penalty (it depends on each
  position's own history). It is an estimate for ranking sets: drafting the window in one pass
  puts more draft-made K/V in each position's context than a step of K drafts does, and the
  prompt is not the text the model will write (on SmolLM2 it came out above the acceptance
  measured while decoding); the metrics report the real one.
- the predicted speed-up of a set with acceptance a is E / (K * draft + V) * T, where
  E = 1 + a + ... + a^K is the expected number of tokens a step emits.

Greedy, as the issue asks: start from skipping nothing, and each round add the layer whose removal
keeps the most acceptance. The first round scores every layer alone; later rounds try only the
`candidates` best-ranked remaining layers, so a round costs a few forward passes of the window.
The search stops after `patience` rounds without a better predicted speed-up, or when its time
`budget` is spent, and returns the best set it saw (`SkipChoice`), with every round's numbers.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from llmopt.errors import OptionError
from llmopt.model.decoder import Decoder
from llmopt.model.kv_cache import StaticKVCache
from llmopt.runtime.sampling import SamplingConfig, probabilities
from llmopt.runtime.self_speculative import skip_view


@dataclass
class SkipChoice:
    """The search's answer: the skip set with the best predicted speed-up, and how it got there."""

    skip: tuple[int, ...]
    acceptance: float  # estimated probability that one drafted token is accepted
    predicted_speedup: float  # decode tokens/s over plain decoding, by the cost model
    step_ms: float  # measured: one full decode step (T)
    head_ms: float  # measured: the LM head alone (H)
    verify_ms: float  # measured: one forward of K+1 tokens (V)
    seconds: float  # the search's own time
    rounds: list[dict] = field(default_factory=list)  # each round: skip, acceptance, draft_cost, predicted_speedup

    @property
    def pays_off(self) -> bool:
        return bool(self.skip) and self.predicted_speedup > 1.0

    def to_dict(self) -> dict:
        return {"skip": list(self.skip), "acceptance": round(self.acceptance, 4),
                "predicted_speedup": round(self.predicted_speedup, 3), "step_ms": round(self.step_ms, 2),
                "head_ms": round(self.head_ms, 2), "verify_ms": round(self.verify_ms, 2),
                "seconds": round(self.seconds, 2), "rounds": self.rounds}


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens one speculative step emits when each of k drafts is kept with probability `acceptance`
    (the accepted prefix, plus the target's own token after it)."""
    return sum(acceptance ** i for i in range(k + 1))


class WindowScorer:
    """The acceptance of a skip set on the last `window` positions of `ids` (module docstring), and
    the measured costs of the pieces of a speculative step on the same cache."""

    def __init__(self, model: Decoder, ids: list[int], window: int, cfg: SamplingConfig, num_draft: int):
        if len(ids) < 2:
            raise OptionError(f"the prompt has {len(ids)} token; <self_speculative>'s search needs at least 2 "
                              "(or give <skip_layers>)")
        self.model, self.cfg, self.num_draft = model, cfg, num_draft
        self.window = min(window, len(ids) - 1)
        self.start = len(ids) - self.window
        param = next(model.parameters())
        self.cache = StaticKVCache(model.arch, len(ids) + num_draft + 1, 1, param.dtype, param.device)
        self.ids = torch.tensor([ids], device=param.device)
        with torch.inference_mode():
            model.hidden(self.ids[:, :self.start], 0, self.cache)
            self.block_calls: list[tuple[tuple, dict]] = []  # each block's arguments in the full pass
            hooks = [b.register_forward_pre_hook(self._record, with_kwargs=True) for b in model.layers]
            try:
                self.p = probabilities(self._window_logits(model), cfg)
            finally:
                for hook in hooks:
                    hook.remove()

    def _record(self, block, args: tuple, kwargs: dict) -> None:
        self.block_calls.append((args, kwargs))

    def _window_logits(self, model: Decoder) -> torch.Tensor:
        """Logits of `model` (the target or a view of it) at each window position, over the full
        model's K/V of everything before the window."""
        self.cache.truncate(self.start)
        return model.lm_head(model.hidden(self.ids[:, self.start:], self.start, self.cache)[0]).float()

    @torch.inference_mode()
    def acceptance(self, skip: tuple[int, ...]) -> tuple[float, float]:
        """(mean acceptance per drafted token, a finer score that breaks its ties): for greedy the
        mean draft probability of the target's token, otherwise the acceptance itself."""
        return self._score(self._window_logits(skip_view(self.model, skip)))

    @torch.inference_mode()
    def acceptance_without(self, layer: int) -> tuple[float, float]:
        """`acceptance((layer,))` for less: the layers before `layer` compute what the full pass
        did, so this starts from the input the full pass gave `layer` and runs only those after it."""
        x = self.block_calls[layer][0][0]
        for block, (args, kwargs) in zip(self.model.layers[layer + 1:], self.block_calls[layer + 1:]):
            x = block(x, *args[1:], **kwargs)
        return self._score(self.model.lm_head(self.model.norm(x)[0]).float())

    def _score(self, logits: torch.Tensor) -> tuple[float, float]:
        accept = torch.minimum(self.p, probabilities(logits, self.cfg)).sum(-1).mean().item()
        if not self.cfg.greedy:
            return accept, accept
        return accept, logits.softmax(-1).gather(-1, self.p.argmax(-1, keepdim=True)).mean().item()

    @torch.inference_mode()
    def costs(self) -> tuple[float, float, float]:
        """(T, H, V) in ms: a full decode step, the LM head alone, a forward of K+1 tokens with the
        LM head on each (as the verification runs), all after the whole text."""
        end = self.ids.shape[1]
        token, block = self.ids[:, -1:], self.ids[:, -1:].expand(1, self.num_draft + 1)

        def forward(ids: torch.Tensor) -> torch.Tensor:
            self.cache.truncate(end)
            return self.model(ids, end, self.cache)

        self.model.hidden(self.ids[:, self.start:], self.start, self.cache)  # the window's K/V, the full model's again
        h = self.model.hidden(token, end, self.cache)[0, -1]
        cuda = h.device.type == "cuda"

        def timed(run: Callable[[], object]) -> float:
            t0 = time.perf_counter()
            run()
            if cuda:
                torch.cuda.synchronize()
            return 1000 * (time.perf_counter() - t0)

        runs = (lambda: forward(token), lambda: self.model.lm_head(h), lambda: forward(block))
        for run in runs:
            timed(run)  # warm-up: first calls allocate
        times = [[timed(run) for run in runs] for _ in range(3)]  # interleaved: other work on the machine hits all alike
        step, head, verify = (min(column) for column in zip(*times))  # the least disturbed of each
        return step, head, verify


def search_skip_layers(model: Decoder, ids: list[int], cfg: SamplingConfig = SamplingConfig(), num_draft: int = 4, *,
                       window: int = 16, candidates: int = 4, patience: int = 2, budget: float = 4.0) -> SkipChoice:
    """The skip set for self-speculative decoding of `model` on text like `ids` (module docstring).
    `budget` (seconds, counted from the start) stops the greedy rounds; the timings, the scores of
    single layers and the first round always complete."""
    t0 = time.perf_counter()
    scorer = WindowScorer(model, ids, window, cfg, num_draft)
    step, head, verify = scorer.costs()
    layers = model.arch.num_layers

    def predicted(acceptance: float, skipped: int) -> tuple[float, float]:
        draft = head + (layers - skipped) / layers * max(step - head, 0.0)
        return expected_tokens(acceptance, num_draft) * step / (num_draft * draft + verify), draft / step

    single = {i: scorer.acceptance_without(i) for i in range(layers)}
    ranking = sorted(single, key=lambda i: single[i], reverse=True)  # the least harmful to skip first
    chosen: tuple[int, ...] = ()
    best: tuple[float, tuple[int, ...], float] = (0.0, (), 1.0)  # (speed-up, skip, acceptance)
    rounds: list[dict] = []
    since_better = 0
    while len(chosen) < layers - 1 and since_better < patience:
        pool = [i for i in ranking if i not in chosen][:candidates]
        scores = {i: (single[i] if not chosen else scorer.acceptance(tuple(sorted(chosen + (i,))))) for i in pool}
        layer = max(pool, key=lambda i: scores[i])
        chosen = tuple(sorted(chosen + (layer,)))
        acceptance = scores[layer][0]
        speedup, draft_cost = predicted(acceptance, len(chosen))
        rounds.append({"skip": list(chosen), "acceptance": round(acceptance, 4), "draft_cost": round(draft_cost, 3),
                       "predicted_speedup": round(speedup, 3)})
        if speedup > best[0]:
            best, since_better = (speedup, chosen, acceptance), 0
        else:
            since_better += 1
        if time.perf_counter() - t0 > budget:
            break
    return SkipChoice(best[1], best[2], best[0], step, head, verify, time.perf_counter() - t0, rounds)
