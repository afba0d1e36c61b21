"""Input statistics of a linear layer: the GPTQ Hessian H = 2/N · Σ x xᵀ over all calibration tokens.

Accumulated in float32 as a running mean so its scale does not grow with the token count; the
outer products are formed chunk by chunk (one matmul per batch of tokens). H is symmetric, so only
its upper block triangle is multiplied out (strips of `STRIP` rows) and the rest is mirrored in place
when read: about 60% of a full XᵀX's work for the 1536-wide MLP input, the same float32 arithmetic.

With `cross=True` it also accumulates GPTAQ's asymmetry term 2/N · Σ (x_fp - x) xᵀ, where x_fp is
what the same linear receives in the full-precision model and x what it receives in the model being
quantized (Li et al. 2025, "GPTAQ: Efficient Finetuning-Free Quantization for Asymmetric Calibration").
"""

from __future__ import annotations

import torch

STRIP = 256  # rows per strip of the upper triangle; measured fastest for widths 576-1536 on CPU


class HessianAccumulator:
    """Running 2/N · XᵀX for one input width; feed it activations of any leading shape."""

    def __init__(self, features: int, device: torch.device | str = "cpu", cross: bool = False):
        self.h = torch.zeros(features, features, dtype=torch.float32, device=device)  # upper block triangle
        self.cross = torch.zeros_like(self.h) if cross else None
        self.tokens = 0
        self._mirrored = False

    def add(self, x: torch.Tensor, x_fp: torch.Tensor | None = None) -> None:
        if self._mirrored:
            raise RuntimeError("the Hessian was read (mirrored in place): it takes no more inputs")
        x = x.reshape(-1, x.shape[-1]).to(device=self.h.device, dtype=torch.float32)
        n = x.shape[0]
        if n == 0:
            return
        total = self.tokens + n
        keep, alpha = self.tokens / total, 2.0 / total
        d = x.shape[1]
        for start in range(0, d, STRIP):
            end = min(start + STRIP, d)
            strip = self.h[start:end, start:]
            strip.mul_(keep)
            strip.addmm_(x[:, start:end].t(), x[:, start:], alpha=alpha)
        if self.cross is not None:
            if x_fp is None:
                raise ValueError("this accumulator also needs the full-precision model's inputs")
            dx = x_fp.reshape(-1, d).to(device=self.h.device, dtype=torch.float32) - x
            self.cross.mul_(keep)
            self.cross.addmm_(dx.t(), x, alpha=alpha)
        self.tokens = total

    def value(self) -> torch.Tensor:
        """The full symmetric H: the upper triangle mirrored in place, a strip at a time (no second
        [in, in] matrix: at an 8B model's MLP input one is 822 MB). The accumulator is then read-only;
        callers that change H work on a copy."""
        if not self._mirrored:
            h, d = self.h, self.h.shape[0]
            for start in range(0, d, STRIP):
                end = min(start + STRIP, d)
                h[start:end, :start] = h[:start, start:end].t()
                block = h[start:end, start:end]
                block.copy_(torch.triu(block) + torch.triu(block, 1).t())
            self._mirrored = True
        return self.h
