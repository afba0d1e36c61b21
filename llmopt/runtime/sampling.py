"""Turning logits into the next token: repetition penalty, temperature, top-k, top-p, min-p.

`probabilities` returns the exact distribution the sampler draws from (one-hot for greedy). Plain
decoding samples it; speculative decoding needs it as the target distribution `p` of the rejection
rule, so both paths share one definition and cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy (argmax)
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def check(self) -> None:
        from llmopt.errors import OptionError

        if self.temperature < 0:
            raise OptionError(f"<temperature> must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise OptionError(f"<top_k> must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise OptionError(f"<top_p> must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p < 1.0:
            raise OptionError(f"<min_p> must be in [0, 1), got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise OptionError(f"<repetition_penalty> must be > 0, got {self.repetition_penalty}")


def apply_repetition_penalty(logits: torch.Tensor, history: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL-style penalty on every token already seen: positive logits divided, negative multiplied."""
    if penalty == 1.0 or history.numel() == 0:
        return logits
    seen = logits.gather(-1, history)
    seen = torch.where(seen > 0, seen / penalty, seen * penalty)
    return logits.scatter(-1, history, seen)


def probabilities(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """The sampling distribution over the last dim of `logits` (float32), after all filters."""
    logits = logits.float()
    if cfg.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / cfg.temperature
    if cfg.top_k > 0 and cfg.top_k < logits.shape[-1]:
        kth = logits.topk(cfg.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_logits, order = logits.sort(-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already reach top_p (the top one always stays)
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= cfg.top_p
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    probs = logits.softmax(-1)
    if cfg.min_p > 0.0:
        probs = probs.masked_fill(probs < cfg.min_p * probs.amax(-1, keepdim=True), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of `probs` ([..., V] -> [...])."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def next_token(logits: torch.Tensor, cfg: SamplingConfig, history: torch.Tensor,
               generator: torch.Generator | None = None) -> int:
    """The next token for one sequence: `logits` [V], `history` [n] (prompt and generated ids)."""
    logits = apply_repetition_penalty(logits.float(), history, cfg.repetition_penalty)
    if cfg.greedy:
        return int(logits.argmax(-1))
    return int(sample(probabilities(logits, cfg), generator))
