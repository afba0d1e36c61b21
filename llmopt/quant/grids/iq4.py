"""IQ4_NL and IQ4_XS: 4-bit indices into a fixed, non-uniform table of 16 int8 levels.

    IQ4_NL: blocks of 32,        w = d·v[i]            (fp16 d per block: 18 bytes / 32, 4.5 bpw)
    IQ4_XS: super-blocks of 256, w = d·(ls - 32)·v[i]  (fp16 d per super-block, 6-bit ls per 32:
                                                        136 bytes / 256, 4.25 bpw)

with v = `codebooks.IQ4_VALUES`. llama.cpp's quantizer (quantize_row_iq4_nl_impl in ggml-quants.c,
used with and without an importance matrix) chooses every 32-sub-block's scale by weighted least
squares over 16 trial inverse scales (127/max, then (t - 127)/max for t = -7..7), each value going to
its nearest level; weights are x², or imatrix·sqrt(σ² + x²) with σ² = 2·Σx²/n over the (super-)block.
IQ4_XS then rounds the sub-scales to 6 bits against the largest one, and both recompute the indices
against the final float scale (not its fp16 rounding), as here.

Codes in the QuantizedTensor are the levels themselves plus 128 (`bits` 8, symmetric), so
(code - 128)·scale is exactly llama.cpp's dequantization d·v[i] (IQ4_XS: scale = d·(ls - 32)) and
every reader of QuantizedTensor works unchanged; the packer maps levels back to 4-bit indices.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from llmopt.quant.grids.codebooks import IQ4_VALUES
from llmopt.quant.grids.layout import QK_K, BlockGrid, BlockParams, importance_major, per_block, superblock_sum_x2
from llmopt.quant.grids.numerics import GROUP_MAX_EPS, blocks_major, c_sqrt, first_absmax, inverse_or_zero, nearest_int, seq_sum
from llmopt.quant.grids.searches import f32_array, kernels
from llmopt.quantized_tensor import QuantizedTensor

SUB = 32  # elements per scale
NTRY = 7  # trials t = -NTRY..NTRY around the plain inverse scale, as llama.cpp's quantize_iq4_nl/xs
CODE_OFFSET = 128  # codes are level + 128


def best_index(values: np.ndarray, a: np.float32) -> int:
    """llama.cpp's `best_index_int8` for one value: the nearest level, the upper one on ties, with
    the differences taken in float32."""
    if a <= values[0]:
        return 0
    if a >= values[-1]:
        return len(values) - 1
    hi = int(np.searchsorted(values, a, side="right"))
    return hi - 1 if a - values[hi - 1] < values[hi] - a else hi


class Levels:
    """A sorted table of integer levels and llama.cpp's rounding onto it, as one table lookup.

    For integer levels the rounding changes only at half-integers (every float32 a with
    a - v[k] < v[k+1] - a lies below the midpoint, which rounds up), so the level of a is that of
    its half-integer cell floor(2a); the table is built from `best_index` at both ends of every cell
    and refuses a table for which that does not hold."""

    def __init__(self, values: tuple[int, ...]) -> None:
        vals = np.asarray(values, dtype=np.float32)
        self.values = torch.from_numpy(vals)
        self.lowest = int(2 * vals[0]) - 2  # the first cell: every a below it rounds to v[0] too
        cells = np.arange(self.lowest, int(2 * vals[-1]) + 2)
        starts = (cells / 2).astype(np.float32)
        ends = np.nextafter(((cells + 1) / 2).astype(np.float32), np.float32(-np.inf))
        index = [best_index(vals, a) for a in starts]
        if index != [best_index(vals, a) for a in ends]:
            raise AssertionError("level table whose rounding changes inside a half-integer cell")
        self.cell_value = vals[index]
        self.codes = self.values.to(torch.int32) + CODE_OFFSET  # the QuantizedTensor code of each index
        index_of_code = torch.zeros(256, dtype=torch.uint8)
        index_of_code[self.codes.long()] = torch.arange(len(values), dtype=torch.uint8)
        self.index_of_code = index_of_code

    def nearest_codes(self, x: torch.Tensor, inv_scale: torch.Tensor) -> torch.Tensor:
        """The code (level + 128) of the level nearest to every x[b, i]·inv_scale[b], x [B, n] on any
        device: uint8 [B, n] there (compiled.table_codes on the CPU)."""
        codes = torch.empty(x.shape, dtype=torch.uint8)
        kernels().table_codes(f32_array(x.cpu()), f32_array(inv_scale.cpu()), self.cell_value, self.lowest, CODE_OFFSET,
                              codes.numpy())  # fmt: skip
        return codes.to(x.device)


IQ4_LEVELS = Levels(IQ4_VALUES)


@dataclass(frozen=True)
class IQ4Grid(BlockGrid):
    """IQ4_NL (`block` 32: one fp16 scale per block) or IQ4_XS (`block` 256: fp16 d and 6-bit sub-scales)."""

    name: str
    block: int
    bits: int = 8  # codes are levels + 128 (see the module docstring); 4 bits an index in the file
    index_bits: int = 4  # what an integer stand-in for this grid needs (AWQ's searches)
    levels: Levels = IQ4_LEVELS

    def chunk(self, w: torch.Tensor, importance: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        rows = w.shape[0]
        scales = self._sub_block_scales(w, importance)
        if self.block == SUB:
            return {"codes": self._codes(w, inverse_or_zero(scales)), "d": scales.to(torch.float16).reshape(rows, -1)}
        n_sub = self.block // SUB
        max_scale = first_absmax(scales.reshape(-1, n_sub).t())
        d = torch.neg(max_scale).div_(32.0)  # an all-zero super-block stores d = -0
        ls = nearest_int(per_block(inverse_or_zero(d), n_sub) * scales).clamp_(-32, 31)
        return {
            "codes": self._codes(w, inverse_or_zero(per_block(d, n_sub) * ls)),
            "d": d.to(torch.float16).reshape(rows, -1),
            "sc": (ls + 32).to(torch.uint8).reshape(rows, -1),
        }

    def _sub_block_scales(self, w: torch.Tensor, importance: torch.Tensor | None) -> torch.Tensor:
        """Every 32-sub-block's least-squares scale, by rows (compiled.iq4_scales): weights x², or
        imatrix·sqrt(σ² + x²) with σ² = 2·Σx²/n over the (super-)block."""
        xr, k = w.reshape(-1, SUB), kernels()
        weights = None
        if importance is not None:
            x, n_sub = blocks_major(w, SUB), self.block // SUB
            sum_x2 = seq_sum(x * x) if n_sub == 1 else superblock_sum_x2(w)
            sigma2 = per_block(sum_x2 * (2.0 / self.block), n_sub)
            weights = (importance_major(importance, w.shape[0], SUB) * c_sqrt(sigma2 + x * x)).t()
        scales = torch.empty(xr.shape[0])
        mode = k.SQUARES if weights is None else k.GIVEN
        k.iq4_scales(f32_array(xr), f32_array(xr if weights is None else weights), mode, self.levels.cell_value,
                     self.levels.lowest, np.float32(self.levels.values[0]), NTRY, np.float32(GROUP_MAX_EPS),
                     scales.numpy())  # fmt: skip
        return scales

    def _codes(self, w: torch.Tensor, inv_scale: torch.Tensor) -> torch.Tensor:
        """Every value's code (nearest level + 128) at its sub-block's inverse scale, [rows, cols] uint8."""
        return self.levels.nearest_codes(w.reshape(-1, SUB), inv_scale).reshape(w.shape)

    def assemble(self, out: dict[str, torch.Tensor]) -> QuantizedTensor:
        d = out["d"].to(torch.float32)
        if "sc" in out:
            scales = d.repeat_interleave(self.block // SUB, dim=1) * (out["sc"].to(torch.float32) - 32)
        else:
            scales = d
        aux = {k: v for k, v in out.items() if k != "codes"}
        return QuantizedTensor(codes=out["codes"], scales=scales, bits=8, group_size=SUB, grid=self.name, aux=aux)

    # error feedback: columns go to the nearest table level with the block's scales fixed
    def round(self, x: torch.Tensor, p: BlockParams, j: int) -> torch.Tensor:
        return self.levels.nearest_codes(x[:, None], inverse_or_zero(p.scale[:, j // p.sub]))[:, 0].to(torch.float32)

    def value(self, q: torch.Tensor, p: BlockParams, j: int) -> torch.Tensor:
        return p.scale[:, j // p.sub] * (q - CODE_OFFSET)


IQ4_NL = IQ4Grid("IQ4_NL", block=SUB)
IQ4_XS = IQ4Grid("IQ4_XS", block=QK_K)
