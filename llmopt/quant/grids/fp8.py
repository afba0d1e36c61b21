"""FP8 E4M3 weights with one float32 scale per output row (vLLM's FP8 W8A8 "channel" weights).

w ≈ v·s with v an e4m3 value (±448 at most, 3 mantissa bits, subnormals down to 2^-9) and
s = max|w_row| / 448; v is `(w / s)` cast to float8_e4m3fn (round to nearest even, after clamping to
±448 so nothing becomes NaN). compressed-tensors' float-quantized format stores v as float8 and s.

Every e4m3 value times 2^9 is an integer of at most 18 bits, so the QuantizedTensor keeps
code = v·2^9 + 2^18 (`bits` 19, symmetric; model/packing.py `fp8_codes`) and scale s·2^-9:
(code − 2^18)·scale is v·s exactly in float32 (v has 4 significant bits), and `dequantize` stays the
one definition of the weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from llmopt.model.packing import FP8_CODE_BITS as BITS
from llmopt.model.packing import FP8_GRID as NAME
from llmopt.model.packing import FP8_OFFSET as OFFSET
from llmopt.model.packing import FP8_STEP as STEP
from llmopt.model.packing import fp8_codes as codes_of
from llmopt.model.packing import fp8_values as values_of
from llmopt.quantized_tensor import QuantizedTensor

FP8_MAX = 448.0


def _levels() -> tuple[int, ...]:
    """Every finite e4m3 value as a code, ascending (253: ±448 ... ±2^-9 and one zero)."""
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
    return tuple(sorted(set(codes_of(values[values.isfinite()]).tolist())))


@dataclass(frozen=True)
class FP8Params:
    scale: torch.Tensor  # float32 [rows]


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    """x (already divided by its scale) as float8_e4m3fn, saturated to ±448."""
    return x.to(torch.float32).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


@dataclass(frozen=True)
class FP8Grid:
    name: str = NAME
    bits: int = BITS
    block: int = 1
    group_size: int = -1  # one scale per output row
    sym: bool = True
    code_levels: ClassVar[tuple[int, ...]] = _levels()  # learned rounding moves codes along them

    def span(self, cols: int) -> int:
        return cols

    def choose(self, w: torch.Tensor, importance: torch.Tensor | None = None) -> FP8Params:
        """The row scales: max|w| / 448 (1 for an all-zero row)."""
        amax = w.to(torch.float32).abs().amax(dim=1)
        return FP8Params(torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)))

    def round(self, x: torch.Tensor, p: FP8Params, j: int = 0) -> torch.Tensor:
        s = p.scale if x.dim() == 1 else p.scale[:, None]
        return codes_of(to_fp8(x.to(torch.float32) / s))

    def value(self, q: torch.Tensor, p: FP8Params, j: int = 0) -> torch.Tensor:
        s = p.scale if q.dim() == 1 else p.scale[:, None]
        return (q.to(torch.int64) - OFFSET).to(torch.float32) * (s / STEP)

    def assemble_spans(self, codes: torch.Tensor, params: list[FP8Params], g_idx: torch.Tensor | None = None) -> QuantizedTensor:
        (p,) = params
        return QuantizedTensor(codes=codes.to(torch.int32), scales=(p.scale / STEP)[:, None], bits=BITS,
                               group_size=-1, grid=NAME)  # fmt: skip

    def quantize(self, weight: torch.Tensor, importance: torch.Tensor | None = None) -> QuantizedTensor:
        w = weight.to(torch.float32)
        p = self.choose(w)
        return self.assemble_spans(self.round(w, p), [p])


FP8 = FP8Grid()


def fp8_grid(module: str) -> FP8Grid:
    """QuantizeSpec.grids of `--scheme fp8-dynamic`: the same grid for every module."""
    return FP8
