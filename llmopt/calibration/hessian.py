"""Input statistics of a linear layer: the GPTQ Hessian H = 2/N · Σ x xᵀ over all calibration tokens.

Accumulated in float32 as a running mean so its scale does not grow with the token count; the
outer products are formed chunk by chunk (one matmul per batch of tokens).
"""

from __future__ import annotations

import torch


class HessianAccumulator:
    """Running 2/N · XᵀX for one input width; feed it activations of any leading shape."""

    def __init__(self, features: int, device: torch.device | str = "cpu"):
        self.h = torch.zeros(features, features, dtype=torch.float32, device=device)
        self.tokens = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).to(device=self.h.device, dtype=torch.float32)
        n = x.shape[0]
        if n == 0:
            return
        total = self.tokens + n
        self.h.mul_(self.tokens / total)
        self.h.addmm_(x.t(), x, alpha=2.0 / total)
        self.tokens = total

    def value(self) -> torch.Tensor:
        return self.h
