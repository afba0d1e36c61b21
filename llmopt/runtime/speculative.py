"""Speculative decoding: cheap proposals, verified by the target model so the output is exact.

The rule (Leviathan et al. 2023; Chen et al. 2023): draft token d_i, drawn from the draft's
distribution q_i, is accepted with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection
the token is resampled from norm(max(0, p_i - q_i)); when all K are accepted, one bonus token comes
from p_{K+1}. Every emitted token is then distributed exactly as the target's p. With greedy
sampling p and q are one-hot, and the same rule reduces to "keep drafts while they equal the
target's argmax, then take the target's argmax" — identical to plain greedy decoding.

Three proposers: another model sharing the tokenizer (`DraftModel`), n-gram lookup in the text
so far (`PromptLookup`, whose proposals are deterministic, i.e. q is one-hot), and the target
itself with layers skipped (`self_speculative.LayerSkipDraft`).
"""

from __future__ import annotations

from typing import Protocol

import torch

from llmopt.model.decoder import Decoder
from llmopt.model.kv_cache import CacheFactory, GenerationCache, StaticKVCache
from llmopt.runtime.sampling import SamplingConfig, apply_repetition_penalty, probabilities, sample


def verify(p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor,
           generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply the rejection rule, batched over leading dims.

    p: [..., K+1, V] target distributions at the K draft positions and the one after;
    q: [..., K, V] the distributions the drafts were drawn from; draft: [..., K] token ids.
    Returns (accepted [...]: how many drafts are kept, token [...]: the next token after them).
    """
    k = draft.shape[-1]
    p_draft = p[..., :k, :].gather(-1, draft.unsqueeze(-1)).squeeze(-1)
    q_draft = q.gather(-1, draft.unsqueeze(-1)).squeeze(-1)
    u = torch.rand(p_draft.shape, generator=generator, device=p.device)
    keep = u * q_draft < p_draft  # u < p/q without dividing by q
    accepted = keep.long().cumprod(-1).sum(-1)
    # row i < K: residual after rejecting draft i; row K: the bonus distribution p_{K+1}
    rows = torch.cat([(p[..., :k, :] - q).clamp_min(0.0), p[..., k:, :]], dim=-2)
    index = accepted[..., None, None].expand(*accepted.shape, 1, p.shape[-1])
    dist = rows.gather(-2, index).squeeze(-2)
    fallback = p.gather(-2, index).squeeze(-2)  # residual mass 0 only when p == q there
    dist = torch.where(dist.sum(-1, keepdim=True) > 0, dist, fallback)
    return accepted, sample(dist / dist.sum(-1, keepdim=True), generator)


def accept_drafts(logits: torch.Tensor, ids: list[int], drafts: list[int], q: torch.Tensor | None,
                  cfg: SamplingConfig, generator: torch.Generator | None) -> tuple[int, int]:
    """The verdict on `drafts` proposed after `ids`, from the target's `logits` [K+1, V] at the last
    id and each draft: how many drafts to keep, and the token after them."""
    n = len(ids)
    history = torch.tensor(ids + drafts, device=logits.device)
    p = torch.stack([probabilities(apply_repetition_penalty(logits[i], history[:n + i], cfg.repetition_penalty), cfg)
                     for i in range(len(drafts) + 1)])
    if q is None:
        q = one_hot_rows(drafts, logits.shape[-1], logits.device)
    accepted, token = verify(p, q.to(p.device), torch.tensor(drafts, device=logits.device, dtype=torch.long), generator)
    return int(accepted), int(token)


def draft_token(logits: torch.Tensor, history: torch.Tensor, cfg: SamplingConfig,
                generator: torch.Generator | None) -> tuple[int, torch.Tensor]:
    """A drafter's next token from its `logits` [V] after `history`, and the distribution q it was
    drawn from (the same filters as the target's p, so the rejection rule compares like with like)."""
    q = probabilities(apply_repetition_penalty(logits.float(), history, cfg.repetition_penalty), cfg)
    return (int(q.argmax()) if cfg.greedy else int(sample(q, generator))), q


def one_hot_rows(tokens: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens, device=device), vocab).float()


class Drafter(Protocol):
    """Proposes up to k next tokens and the distributions they were drawn from (None = one-hot)."""

    def propose(self, ids: list[int], k: int, cfg: SamplingConfig,
                generator: torch.Generator | None) -> tuple[list[int], torch.Tensor | None]: ...

    def begin(self, cache: GenerationCache) -> None:
        """A generation starts; `cache` is the target's (empty: the prompt's prefill comes next)."""

    def rollback(self, valid: int) -> None:
        """Only the first `valid` tokens of the sequence last proposed on are still current."""


class PromptLookup:
    """Draft by finding the latest earlier occurrence of the last n-gram and copying what followed.

    Tries n = ngram down to 1 (longest match wins). Costs nothing but a scan; pays off when the
    output repeats the input (editing, summarizing with quotes, code).
    """

    def __init__(self, ngram: int = 3):
        self.ngram = ngram

    def propose(self, ids: list[int], k: int, cfg: SamplingConfig,
                generator: torch.Generator | None) -> tuple[list[int], torch.Tensor | None]:
        seq = torch.tensor(ids)
        for n in range(min(self.ngram, len(ids) - 1), 0, -1):
            windows = seq[:-1].unfold(0, n, 1) if len(ids) - 1 >= n else seq[:0].view(0, n)
            hits = (windows == seq[-n:]).all(-1).nonzero().flatten()
            for start in hits.flip(0).tolist():  # latest first
                follow = ids[start + n: start + n + k]
                if follow:
                    return follow, None
        return [], None

    def begin(self, cache: GenerationCache) -> None:
        pass

    def rollback(self, valid: int) -> None:
        pass


class DraftModel:
    """A smaller (or quantized) model with its own KV cache, run ahead k tokens at a time."""

    def __init__(self, model: Decoder, max_len: int, dtype: torch.dtype, device: torch.device,
                 cache_factory: CacheFactory = StaticKVCache):
        self.model = model
        self.cache = cache_factory(model.arch, max_len, 1, dtype, device)
        self.device = device

    @torch.inference_mode()
    def propose(self, ids: list[int], k: int, cfg: SamplingConfig,
                generator: torch.Generator | None) -> tuple[list[int], torch.Tensor | None]:
        history = torch.tensor(ids, device=self.device)
        pending = history[self.cache.length:]  # at least the last committed token
        drafts: list[int] = []
        qs = []
        for _ in range(k):
            start = self.cache.length
            h = self.model.hidden(pending[None], start, self.cache)
            token, q = draft_token(self.model.lm_head(h[0, -1]), history, cfg, generator)
            drafts.append(token)
            qs.append(q)
            pending = torch.tensor([token], device=self.device)
            history = torch.cat([history, pending])
        return drafts, torch.stack(qs)

    def begin(self, cache: GenerationCache) -> None:
        self.cache.truncate(0)  # its own cache: a new prompt is drafted from scratch

    def rollback(self, valid: int) -> None:
        self.cache.truncate(valid)
