"""NVFP4 as compressed-tensors writes it (`nvfp4-pack-quantized`, vLLM's and NVIDIA ModelOpt's NVFP4): E2M1
values in groups of 16 columns, each group's scale a float8 e4m3 value s8, and one float32 global scale g per
tensor: w = v·(s8 / g).

The global scale makes the e4m3 scales use their range: g = 448·6 / max|W| (1 where that is not finite), and
each group's s8 = e4m3(g·max|group| / 6) (0.125 where that rounds to 0), as compressed-tensors'
`generate_gparam` and `calculate_qparams` compute them. A value rounds to the nearest E2M1 value of
x / (s8 / g), ties to the even mantissa (compressed-tensors' `cast_to_fp4`, and the hardware's cvt.rn).

Codes are the E2M1 values doubled plus 128 (`model/packing.py` FP4_VALUES; `bits` 8, symmetric) with the scale
(s8 / g) / 2, so `dequantize` is exactly the float32 v·(s8 / g) that compressed-tensors' dequantizer computes
before it casts to its own dtype. `aux` keeps s8 (`group_scale`, float32 values of e4m3) and g
(`global_scale`, [1, 1]) for the writer. The linears of one stage share g (`per_stage`): vLLM runs q/k/v and
gate/up as one fused linear with one global scale (the largest of the parts'), as llm-compressor writes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from llmopt.errors import InputError
from llmopt.model.packing import FP4_CODE_OFFSET, FP4_LEVELS, NVFP4_GRID, NVFP4_GROUP, nvfp4_scales
from llmopt.quant.grids.fp8 import FP8_MAX
from llmopt.quantized_tensor import QuantizedTensor

FP4_MAX = 6.0
ZERO_SCALE = 0.125  # compressed-tensors' stand-in for an e4m3 group scale of 0
_TIE_DOWN = torch.tensor([0.25, 1.25, 2.5, 5.0])  # midpoints that round to the smaller magnitude (its mantissa even)
_TIE_UP = torch.tensor([0.75, 1.75, 3.5])  # ... and to the larger one
_DOUBLED = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12], dtype=torch.float32)  # the magnitudes' codes − 128, by rank


@dataclass(frozen=True)
class NVFP4Params:
    group_scale: torch.Tensor  # float32 values of e4m3 [rows, groups]
    global_scale: torch.Tensor  # float32 [1, 1]
    scale: torch.Tensor  # the codes' scale, (s8 / g) / 2 [rows, groups]: `nvfp4_scales`

    @staticmethod
    def of(group_scale: torch.Tensor, global_scale: torch.Tensor) -> NVFP4Params:
        return NVFP4Params(group_scale, global_scale, nvfp4_scales(group_scale, global_scale))


def global_scale(w: torch.Tensor) -> torch.Tensor:
    """g = 448·6 / max|w| as float32 [1, 1] (1 where it is not finite)."""
    amax = w.to(torch.float32).abs().amax().clamp(min=torch.finfo(torch.float32).tiny)
    return torch.nan_to_num(FP8_MAX * FP4_MAX / amax, nan=1.0, posinf=1.0, neginf=1.0).reshape(1, 1)


def nearest_codes(a: torch.Tensor) -> torch.Tensor:
    """The codes of the E2M1 values nearest a (already divided by its scale; clamped to ±6), ties to even."""
    m = a.abs()  # its rank among the magnitudes: the midpoints below it, ties down or up as each midpoint says
    rank = torch.bucketize(m, _TIE_DOWN.to(m.device)) + torch.bucketize(m, _TIE_UP.to(m.device), right=True)
    v = _DOUBLED.to(a.device)[rank]
    return (torch.where(a < 0, -v, v) + FP4_CODE_OFFSET).to(torch.uint8)


@dataclass(frozen=True)
class NVFP4TensorGroupGrid:
    name: str = NVFP4_GRID
    bits: int = 8  # codes are doubled values + 128; 4 bits an index in the file
    code_levels: ClassVar[tuple[int, ...]] = FP4_LEVELS  # learned rounding moves codes along them
    block: int = NVFP4_GROUP
    group_size: int = NVFP4_GROUP
    sym: bool = True
    per_stage: bool = True  # a stage's linears are quantized as one tensor: one global scale

    def span(self, cols: int) -> int:
        """The whole row: the global scale is the tensor's, so every group's scale is chosen up front."""
        if cols % self.block:
            raise InputError(f"NVFP4 needs rows that are a multiple of {self.block}, got {cols}")
        return cols

    def choose(self, w: torch.Tensor, importance: torch.Tensor | None = None) -> NVFP4Params:
        w = w.to(torch.float32)
        g = global_scale(w)
        amax = w.reshape(w.shape[0], -1, self.group_size).abs().amax(dim=-1)
        s8 = (g * (amax / FP4_MAX)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32)
        return NVFP4Params.of(torch.where(s8 == 0, torch.full_like(s8, ZERO_SCALE), s8), g)

    def round(self, x: torch.Tensor, p: NVFP4Params, j: int = 0) -> torch.Tensor:
        """Column j's codes, x [rows] (or every column: x [rows, cols])."""
        # the dequantizer's float32 scale s8 / g (the codes' scale doubled: halving and doubling are exact)
        d = p.scale[:, j // self.group_size] * 2 if x.dim() == 1 else (p.scale * 2).repeat_interleave(self.group_size, dim=1)
        return nearest_codes((x.to(torch.float32) / d).clamp(-FP4_MAX, FP4_MAX))

    def value(self, q: torch.Tensor, p: NVFP4Params, j: int = 0) -> torch.Tensor:
        return (q.to(torch.float32) - FP4_CODE_OFFSET) * p.scale[:, j // self.group_size]

    def assemble_spans(self, codes: torch.Tensor, params: list[NVFP4Params],
                       g_idx: torch.Tensor | None = None) -> QuantizedTensor:  # fmt: skip
        if g_idx is not None:
            raise InputError("NVFP4 has no column permutation (g_idx); use static groups with act-order")
        (p,) = params
        return QuantizedTensor(codes=codes.to(torch.uint8), scales=p.scale, bits=self.bits, group_size=self.group_size,
                               grid=self.name, aux={"group_scale": p.group_scale, "global_scale": p.global_scale})  # fmt: skip

    def quantize(self, weight: torch.Tensor, importance: torch.Tensor | None = None) -> QuantizedTensor:
        w = weight.to(torch.float32)
        self.span(w.shape[1])
        p = self.choose(w)
        return self.assemble_spans(self.round(w, p), [p])


NVFP4 = NVFP4TensorGroupGrid()


def nvfp4_grid(module: str) -> NVFP4TensorGroupGrid:
    """QuantizeSpec.grids of `--scheme nvfp4`/`nvfp4a16`: the same grid for every module."""
    return NVFP4
