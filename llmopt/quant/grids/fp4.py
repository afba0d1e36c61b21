"""MXFP4: blocks of 32 E2M1 values (±0, 0.5, 1, 1.5, 2, 3, 4, 6) sharing one E8M0 power-of-two scale.

w = 2^(e-128)·v[i] with v = `codebooks.FP4_VALUES` (the E2M1 values doubled, so the stored scale is
halved) and e one byte per block: 17 bytes / 32 = 4.25 bpw. llama.cpp's quantizer
(quantize_row_mxfp4_ref in ggml-quants.c, which ignores an importance matrix) takes
e = floor(log2(max|x|)) - 2 + 127 (0 for an all-zero block; a byte, so it wraps below 2^-125) and gives
every value the index of least |v[i]·scale - x|, the first one on ties.

Codes in the QuantizedTensor are v[i] + 128 (`bits` 8, symmetric): (code - 128)·scale is the value.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from llmopt.quant.grids.codebooks import FP4_VALUES
from llmopt.quant.grids.layout import BlockGrid, BlockParams, to_rows
from llmopt.quant.grids.numerics import blocks_major
from llmopt.quantized_tensor import QuantizedTensor

QK = 32
CODE_OFFSET = 128
VALUES = torch.tensor(FP4_VALUES, dtype=torch.float32)
CODES = VALUES.to(torch.int32) + CODE_OFFSET  # the QuantizedTensor code of each index
INDEX_OF_CODE = torch.zeros(256, dtype=torch.uint8)  # code -> the first index with that value (0 for ±0)
for _i in reversed(range(len(FP4_VALUES))):
    INDEX_OF_CODE[int(CODES[_i])] = _i
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


def half_scale(e: torch.Tensor) -> torch.Tensor:
    """ggml_e8m0_to_fp32_half: 2^(e - 128) as float32 (denormal for e < 2)."""
    return torch.ldexp(torch.ones(e.shape, dtype=torch.float64), e.to(torch.float64) - 128).to(torch.float32)


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


@dataclass(frozen=True)
class MXFP4Grid(BlockGrid):
    name: str = "MXFP4"
    block: int = QK
    bits: int = 8  # codes are values + 128; 4 bits an index in the file

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
