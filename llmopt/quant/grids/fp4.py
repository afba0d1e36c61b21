"""MXFP4 and NVFP4: E2M1 values (±0, 0.5, 1, 1.5, 2, 3, 4, 6) with shared 8-bit scales.

MXFP4: blocks of 32 values sharing one E8M0 power-of-two scale.

w = 2^(e-128)·v[i] with v = `codebooks.FP4_VALUES` (the E2M1 values doubled, so the stored scale is
halved) and e one byte per block: 17 bytes / 32 = 4.25 bpw. llama.cpp's quantizer
(quantize_row_mxfp4_ref in ggml-quants.c, which ignores an importance matrix) takes
e = floor(log2(max|x|)) - 2 + 127 (0 for an all-zero block; a byte, so it wraps below 2^-125) and gives
every value the index of least |v[i]·scale - x|, the first one on ties.

NVFP4: blocks of 64 = 4 sub-blocks of 16, each with a UE4M3 scale byte (4 exponent bits, bias 7, 3
mantissa bits): w = s·v[i] with s = ue4m3(byte)/2, 36 bytes / 64 = 4.5 bpw. llama.cpp
(quantize_row_nvfp4_ref) rounds max|x|/6 to UE4M3 (ggml_fp32_to_ue4m3) and picks indices as for
MXFP4. There is no NVFP4 mix in llama-quantize (llama_ftype_get_default_type has none); the type goes
on tensors by `--tensor-type`.

Codes in the QuantizedTensor are v[i] + 128 (`bits` 8, symmetric): (code - 128)·scale is the value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from llmopt.model.packing import FP4_CODE_OFFSET as CODE_OFFSET
from llmopt.model.packing import FP4_CODES as CODES
from llmopt.model.packing import FP4_INDEX_OF_CODE as INDEX_OF_CODE
from llmopt.model.packing import FP4_LEVELS
from llmopt.model.packing import FP4_VALUES
from llmopt.model.packing import e8m0_half_scale as half_scale  # ggml_e8m0_to_fp32_half
from llmopt.quant.grids.layout import BlockGrid, BlockParams, to_rows
from llmopt.quant.grids.numerics import blocks_major
from llmopt.quantized_tensor import QuantizedTensor

QK = 32
VALUES = torch.tensor(FP4_VALUES, dtype=torch.float32)
_MAGNITUDES = sorted({abs(v) for v in FP4_VALUES})  # 0, 1, 2, 3, 4, 6, 8, 12
# the magnitude of every cell c = ceil(2|a|): the largest one whose lower midpoint 2m is below c
MAGNITUDE_OF_CELL = np.array([max(v for i, v in enumerate(_MAGNITUDES) if i == 0 or c > _MAGNITUDES[i - 1] + v)
                              for c in range(2 * _MAGNITUDES[-1] + 1)], dtype=np.float32)  # fmt: skip


def shared_exponent(amax: torch.Tensor) -> torch.Tensor:
    """The E8M0 byte of each block: (uint8_t)(floorf(log2f(amax)) - 2 + 127), 0 where amax is 0.
    log2f is taken as the correctly rounded float32 of the float64 log2; the byte wraps as C's cast
    does on x86 for the negative results of denormal maxima."""
    log2 = torch.log2(amax.to(torch.float64)).to(torch.float32).to(torch.float64)
    e = torch.floor(log2).to(torch.int64) + 125
    return torch.where(amax > 0, torch.remainder(e, 256), torch.zeros_like(e))


def nearest_codes(x: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """best_index_mxfp4 as codes: the first index of least |v·d - x| (x [n, B], d [B]).

    d is a power of two, so a = x/d is exact and the float32 errors |v·d - x| compare as |v - a| do;
    measured that way, v[i+1] beats v[i] exactly when |a| is above their midpoint (ties keep the first
    index: the smaller magnitude, and +0 for zero). The midpoints are multiples of 1/2, so the
    magnitude is a lookup by ceil(2|a|)."""
    a = (x / d).numpy()
    cell = np.ceil(np.multiply(np.abs(a), 2))
    np.minimum(cell, len(MAGNITUDE_OF_CELL) - 1, out=cell)
    v = MAGNITUDE_OF_CELL.take(cell.astype(np.intp))
    return torch.from_numpy(np.where(a < 0, -v, v) + np.float32(CODE_OFFSET))


def nearest_codes_exact(x: np.ndarray, d: np.ndarray) -> torch.Tensor:
    """best_index_mxfp4 as codes for any scale d >= 0 (x [n, B], d [B], float32): the nearest
    magnitude is one of the two around |x|/d, and between those two the float32 errors decide as
    C's loop does (|v·d - x| with v·d exact: v has 4 significant bits and d, a UE4M3, 4 too), ties
    to the first index, the smaller magnitude."""
    magnitudes = np.asarray(_MAGNITUDES, dtype=np.float32)
    ax = np.abs(x)
    a = np.divide(ax, d, out=np.zeros_like(ax), where=d > 0)  # only to find the pair around |x|
    j = np.searchsorted(magnitudes, np.floor(np.minimum(a, magnitudes[-1])), side="right") - 1
    np.minimum(j, len(magnitudes) - 2, out=j)
    lo, hi = magnitudes[j], magnitudes[j + 1]
    upper = np.abs(hi * d - ax) < np.abs(lo * d - ax)
    v = np.where(upper, hi, lo)
    return torch.from_numpy(np.where(x < 0, -v, v) + np.float32(CODE_OFFSET))


def fp32_to_ue4m3(x: np.ndarray) -> np.ndarray:
    """ggml_fp32_to_ue4m3: the UE4M3 byte of each float32 (0 for x <= 0 or NaN, 0x7E = 448 at most),
    the mantissa rounded half up on its 4th bit."""
    x = np.minimum(np.where(x > 0, x, 0).astype(np.float32), np.float32(448.0))
    bits = x.view(np.int32)
    exp = ((bits >> 23) & 0xFF) - 127 + 7
    man = ((bits >> 20) & 7) + ((bits >> 19) & 1)
    exp = np.where(man > 7, exp + 1, exp)
    man = np.where(man > 7, 0, man)
    normal = np.where(exp >= 15, 0x7E, (exp << 3) | man)
    sub = np.clip((x * np.float32(512.0) + np.float32(0.5)).astype(np.int32), 0, 7)  # exp <= 0: man·2^-9
    ue4m3_exp = ((bits >> 23) & 0xFF) - 127 + 7
    out = np.where(ue4m3_exp <= 0, sub, normal)
    return np.where(x > 0, out, 0).astype(np.uint8)


def ue4m3_half(u: torch.Tensor) -> torch.Tensor:
    """ggml_ue4m3_to_fp32: the scale of a UE4M3 byte, halved (0 for 0 and 0x7F), exact in float32."""
    u = u.to(torch.int64)
    exp, man = (u >> 3) & 0xF, (u & 7).to(torch.float64)
    raw = torch.where(exp == 0, torch.ldexp(man, torch.tensor(-9.0, dtype=torch.float64)),
                      torch.ldexp(1 + man / 8, (exp - 7).to(torch.float64)))  # fmt: skip
    return torch.where((u == 0) | (u == 0x7F), 0.0, raw * 0.5).to(torch.float32)


@dataclass(frozen=True)
class NVFP4Grid(BlockGrid):
    name: str = "NVFP4"
    code_levels: ClassVar[tuple[int, ...]] = FP4_LEVELS
    block: int = 64
    bits: int = 8  # codes are values + 128; 4 bits an index in the file
    index_bits: int = 4  # what an integer stand-in for this grid needs (AWQ's searches)
    sub: int = 16

    def chunk(self, w: torch.Tensor, importance: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        rows = w.shape[0]
        x = blocks_major(w, self.sub)  # [16, sub-blocks]
        amax = x.abs().amax(dim=0).numpy()
        ue = fp32_to_ue4m3(amax / np.float32(6.0))
        d = ue4m3_half(torch.from_numpy(ue)).numpy()
        codes = nearest_codes_exact(x.numpy(), d)
        return {"codes": to_rows(codes, rows).to(torch.uint8), "ue": torch.from_numpy(ue).reshape(rows, -1)}

    def assemble(self, out: dict[str, torch.Tensor]) -> QuantizedTensor:
        return QuantizedTensor(codes=out["codes"], scales=ue4m3_half(out["ue"]), bits=8, group_size=self.sub,
                               grid=self.name, aux={"ue": out["ue"]})  # fmt: skip

    def round(self, x: torch.Tensor, p: BlockParams, j: int) -> torch.Tensor:
        d = p.scale[:, j // p.sub].contiguous()
        return nearest_codes_exact(x[None].contiguous().numpy(), d.numpy())[0]

    def value(self, q: torch.Tensor, p: BlockParams, j: int) -> torch.Tensor:
        return p.scale[:, j // p.sub] * (q - CODE_OFFSET)


@dataclass(frozen=True)
class MXFP4Grid(BlockGrid):
    name: str = "MXFP4"
    code_levels: ClassVar[tuple[int, ...]] = FP4_LEVELS
    block: int = QK
    bits: int = 8  # codes are values + 128; 4 bits an index in the file
    index_bits: int = 4  # what an integer stand-in for this grid needs (AWQ's searches)

    def chunk(self, w: torch.Tensor, importance: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        rows = w.shape[0]
        x = blocks_major(w, QK)  # [32, blocks]
        e = shared_exponent(x.abs().amax(dim=0))
        codes = nearest_codes(x, half_scale(e))
        return {"codes": to_rows(codes, rows).to(torch.uint8), "e": e.to(torch.uint8).reshape(rows, -1)}

    def assemble(self, out: dict[str, torch.Tensor]) -> QuantizedTensor:
        return QuantizedTensor(codes=out["codes"], scales=half_scale(out["e"]), bits=8, group_size=QK, grid=self.name,
                               aux={"e": out["e"]})  # fmt: skip

    # error feedback: the nearest E2M1 value with the block's exponent fixed
    def round(self, x: torch.Tensor, p: BlockParams, j: int) -> torch.Tensor:
        return nearest_codes(x[None], p.scale[:, j // p.sub])[0]

    def value(self, q: torch.Tensor, p: BlockParams, j: int) -> torch.Tensor:
        return p.scale[:, j // p.sub] * (q - CODE_OFFSET)


MXFP4 = MXFP4Grid()
NVFP4 = NVFP4Grid()


def mxfp4_grid(module: str) -> MXFP4Grid:
    """QuantizeSpec.grids of `--scheme mxfp4a16` (compressed-tensors' MXFP4 holds llama.cpp's MXFP4 blocks as they
    are): the same grid for every module."""
    return MXFP4
