"""The uniform integer grid of GPTQ/AWQ checkpoints: codes 0..2**bits-1 with a scale and zero per group.

    symmetric:  w ≈ (q - 2**(bits-1)) * scale,  scale = 2*max|w| / (2**bits - 1)   (GPTQ's convention)
                or (sym_scale "tight") scale = max(max / (2**(bits-1) - 1), -min / 2**(bits-1)): the
                smallest scale whose codes reach both ends of the group, the extra negative code used
    asymmetric: w ≈ (q - zero) * scale,         scale = (max - min) / (2**bits - 1), zero = round(-min/scale)

The range always includes 0 (min <= 0 <= max) so that zero is a code, as in GPTQ. `zero_min=1` keeps
asymmetric zero points >= 1 because GPTQ format v1 stores zero-1 and a stored -1 would wrap (see
llmopt.model.packing); a group that would get zero 0 instead gets zero 1 and a scale that still
reaches its maximum. Scales are float16 values, as checkpoints store them. `mse=True` searches a
shrink factor of the range per row that minimises the |w - ŵ|^2.4 error (GPTQ's clipping search).
`group_size` is the columns per group: > 0 per group (the last one may be partial), -1 one group per
output row (per channel), 0 one scale for the whole tensor (round-to-nearest only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from llmopt.quantized_tensor import QuantizedTensor


@dataclass(frozen=True)
class IntParams:
    """One group's parameters for every row: scale and integer-valued zero point, float32 [rows]."""

    scale: torch.Tensor
    zero: torch.Tensor


@dataclass(frozen=True)
class IntGrid:
    bits: int = 4
    sym: bool = True
    group_size: int = 128
    zero_min: int = 0  # 1 when writing GPTQ format v1 asymmetric checkpoints
    mse: bool = False  # search a clipping range per row
    mse_grid: int = 100
    mse_max_shrink: float = 0.8
    mse_norm: float = 2.4
    sym_scale: str = "gptq"  # symmetric: "gptq" (2·max|w|/maxq) or "tight" (see the module docstring)
    name: str = "int"
    block: int = 1  # any row length
    uniform: ClassVar[bool] = True  # each weight is (q - zero)·scale: learned rounding (quant/tune.py) may move q

    @property
    def maxq(self) -> int:
        return (1 << self.bits) - 1

    def span(self, cols: int) -> int:
        """Columns whose parameters are chosen together: one group."""
        return cols if self.group_size <= 0 else self.group_size

    # ------------------------------------------------------------------ choose, round, value
    def choose(self, w: torch.Tensor, importance: torch.Tensor | None = None) -> IntParams:
        """Scale and zero point per row of `w` [rows, cols]. `importance` [cols] weights each column's
        error in the clipping search (GPTQ passes diag H)."""
        return IntParams(*self.params(w, importance))

    def round(self, x: torch.Tensor, p: IntParams, j: int = 0) -> torch.Tensor:
        """Codes of one column [rows] (or several, [rows, c]) with fixed parameters."""
        return self.quantize_with(x, p.scale, p.zero)

    def value(self, q: torch.Tensor, p: IntParams, j: int = 0) -> torch.Tensor:
        """What codes `q` stand for."""
        return self.dequantize(q, p.scale, p.zero)

    def assemble_spans(self, codes: torch.Tensor, params: list[IntParams], g_idx: torch.Tensor | None = None) -> QuantizedTensor:
        """The QuantizedTensor of `codes` [rows, cols] with one IntParams per group, in group order."""
        scales = torch.stack([p.scale for p in params], dim=1)
        zeros = torch.stack([p.zero for p in params], dim=1)
        return self._result(codes, scales, zeros, g_idx)

    # ------------------------------------------------------------------ round to nearest, whole matrix
    def quantize(self, weight: torch.Tensor, importance: torch.Tensor | None = None) -> QuantizedTensor:
        """Every group of `weight` [out, in] rounded to the nearest grid point on its own."""
        w = weight.to(torch.float32)
        rows, cols = w.shape
        if self.group_size == 0:
            scale, zero = self.params(w.reshape(1, -1))
            codes = self.quantize_with(w, scale.expand(rows), zero.expand(rows))
            return self._result(codes, scale.view(1, 1), zero.view(1, 1))
        groups = self._groups(w)
        scale, zero = self.params(groups)
        codes = self.quantize_with(groups, scale, zero).view(rows, -1)[:, :cols]
        n = groups.shape[0] // rows
        return self._result(codes, scale.view(rows, n), zero.view(rows, n))

    def round_trip(self, weight: torch.Tensor) -> torch.Tensor:
        """`quantize(weight).dequantize()`, the same float32 values, without forming codes and per-column
        parameters: AWQ's searches round every candidate of every linear."""
        w = weight.to(torch.float32)
        if self.group_size == 0:
            return self.quantize(w).dequantize(torch.float32)
        groups = self._groups(w)
        scale, zero = self.params(groups)
        return self.fake_quantize(groups, scale, zero).view(w.shape[0], -1)[:, : w.shape[1]]

    def _groups(self, w: torch.Tensor) -> torch.Tensor:
        """`w` [rows, cols] as [rows * groups, group columns], the last group padded."""
        rows, cols = w.shape
        g = cols if self.group_size < 0 else self.group_size
        n = group_count(cols, self.group_size)
        pad = n * g - cols
        if not pad:
            return w.reshape(rows * n, g)
        groups = torch.nn.functional.pad(w, (0, pad)).view(rows, n, g)
        groups[:, -1, g - pad:] = groups[:, -1, : 1].expand(rows, pad)  # repeat a real value: the range stays the group's
        return groups.view(rows * n, g)

    def _result(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                g_idx: torch.Tensor | None = None) -> QuantizedTensor:  # fmt: skip
        return QuantizedTensor(codes=codes.to(torch.uint8), scales=scales, bits=self.bits, group_size=self.group_size,
                               zeros=None if self.sym else zeros.to(torch.int32), g_idx=g_idx, grid=self.name)  # fmt: skip

    # ------------------------------------------------------------------ the arithmetic
    def params(self, w: torch.Tensor, importance: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Scale and zero point per row of `w` [rows, cols] (float32 [rows] each; zero is integer-valued)."""
        w = w.to(torch.float32)
        lo = w.min(dim=1).values.clamp(max=0)
        hi = w.max(dim=1).values.clamp(min=0)
        scale, zero = self._range_params(lo, hi)
        if not self.mse:
            return scale, zero
        best = torch.full_like(scale, float("inf"))
        for i in range(int(self.mse_max_shrink * self.mse_grid)):
            p = 1 - i / self.mse_grid
            s, z = self._range_params(lo * p, hi * p)
            err = (self.fake_quantize(w, s, z) - w).abs().pow(self.mse_norm)
            err = (err if importance is None else err * importance).sum(dim=1)
            better = err < best
            best = torch.where(better, err, best)
            scale = torch.where(better, s, scale)
            zero = torch.where(better, z, zero)
        return scale, zero

    def _range_params(self, lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        maxq = self.maxq
        if self.sym:
            half = 1 << (self.bits - 1)
            if self.sym_scale == "tight":  # +max on code half-1 or -min on code -half, whichever needs more
                raw = torch.maximum(hi / (half - 1), -lo / half)
            else:  # GPTQ's: ±max|w| half a step beyond the outer codes
                raw = 2 * torch.maximum(lo.abs(), hi) / maxq
            scale = fp16_exact(torch.where(raw == 0, torch.ones_like(raw), raw))
            return scale, torch.full_like(scale, float(half))
        span = hi - lo
        scale = fp16_exact(torch.where(span == 0, torch.ones_like(span), span / maxq))
        zero = torch.round(-lo / scale).clamp(0, maxq)
        if self.zero_min > 0:
            low = zero < self.zero_min
            # zero forced up to zero_min: the codes above it must still reach `hi`
            lifted = fp16_exact(torch.where(hi > 0, hi / (maxq - self.zero_min), scale))
            scale = torch.where(low, torch.maximum(scale, lifted), scale)
            zero = torch.where(low, torch.full_like(zero, float(self.zero_min)), zero)
        return scale, zero

    def quantize_with(self, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        """Codes for `w` [rows, cols] (or [rows]) given per-row (or broadcastable) scale and zero."""
        s, z = _col(scale, w), _col(zero, w)
        return torch.clamp(torch.round(w.to(torch.float32) / s) + z, 0, self.maxq)

    def dequantize(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        return (q - _col(zero, q)) * _col(scale, q)

    def fake_quantize(self, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        return self.dequantize(self.quantize_with(w, scale, zero), scale, zero)


class OnIntGrid:
    """A method config's integer grid, built in one place from its fields (bits, sym, group_size,
    zero_min, mse, sym_scale): RTN, GPTQ and AWQ configs all round onto it."""

    def grid(self) -> IntGrid:
        c: Any = self
        return IntGrid(c.bits, c.sym, c.group_size, c.zero_min, c.mse, sym_scale=c.sym_scale)


def fp16_exact(scale: torch.Tensor) -> torch.Tensor:
    """Scales as the float16 values checkpoints store (rounded up when needed so no range is lost to
    rounding below, and never 0), so codes are chosen against the scale a reader will use."""
    s16 = scale.to(torch.float16)
    s16 = torch.where(s16.to(torch.float32) < scale, torch.nextafter(s16, torch.full_like(s16, float("inf"))), s16)
    return s16.to(torch.float32).clamp(min=2.0**-24)


def _col(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Per-row parameters broadcast against a [rows, cols] (or [rows]) tensor."""
    return t.unsqueeze(1) if like.dim() == 2 and t.dim() == 1 else t


def group_count(in_features: int, group_size: int) -> int:
    return 1 if group_size <= 0 else -(-in_features // group_size)
