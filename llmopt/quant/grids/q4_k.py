"""Q4_K and Q5_K: 256-element super-blocks of 8 sub-blocks of 32, each with a 6-bit scale and min.

w = d·sc[j]·q - dmin·m[j], q in [0, 15] (Q4_K) or [0, 31] (Q5_K); d and dmin are fp16 per
super-block, sc and m 6-bit per sub-block. Without an importance matrix, llama.cpp's reference picks
each sub-block's scale and min with `make_qkx2_quants` weighted by rms(x) + |x| and rounds them
against the super-block maximum; with one, `make_qkx3_quants` weighted by imatrix·sqrt(σ² + x²) and
`make_qp_quants` for the 6-bit sub-scales.
"""

from __future__ import annotations

from dataclasses import dataclass

from typing import ClassVar

import torch

from llmopt.quant.grids.layout import QK_K, BlockGrid, importance_major, per_block, scale_min_fields, scale_min_tensor, superblock_sum_x2
from llmopt.quant.grids.numerics import blocks_major, c_sqrt, fp16, nearest_int, positive_max, rdiv, seq_sum, uint8_wrap
from llmopt.quant.grids.searches import make_qkx_quants, make_qp_quants, qkx_rows
from llmopt.quantized_tensor import QuantizedTensor

SUB = 32  # elements per sub-block
N_SUB = QK_K // SUB


@dataclass(frozen=True)
class AsymKGrid(BlockGrid):
    uniform: ClassVar[bool] = True
    name: str
    nmax: int  # 15 for Q4_K, 31 for Q5_K
    bits: int
    ref_search: tuple[float, float, int]  # (rmin, rdelta, nstep) of make_qkx2_quants
    block: int = QK_K

    def chunk(self, w: torch.Tensor, importance: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        rows = w.shape[0]
        if importance is None:  # blocks by rows ([sub-blocks, 32], a view of w): one compiled search and requantization
            x = w.reshape(-1, SUB)
            scales, mins, L = qkx_rows(x, None, self.nmax, *self.ref_search, use_mad=False)
            ls, lm, d, dmin = _round_sub_scales(scales, mins)
            return scale_min_fields(x, L, d, dmin, ls, lm, self.nmax, rows)
        x = blocks_major(w, SUB)  # [32, sub-blocks]
        sigma2 = 2 * superblock_sum_x2(w) / QK_K
        weights = importance_major(importance, rows, SUB) * c_sqrt(per_block(sigma2, N_SUB) + x * x)
        sw = seq_sum(weights)
        scales, mins, L = make_qkx_quants(x, weights, self.nmax, -0.9, 0.05, 36, use_mad=False)
        d_block, ls = make_qp_quants(_by_superblock(scales), 63, _by_superblock(sw))
        m_block, lm = make_qp_quants(_by_superblock(mins), 63, _by_superblock(sw))
        ls, lm = ls.t().reshape(-1).clamp(max=63), lm.t().reshape(-1).clamp(max=63)
        # requantize every sub-block against the stored (fp16 x 6-bit) scale and min
        return scale_min_fields(x.t(), L.t(), fp16(d_block), fp16(m_block), ls, lm, self.nmax, rows)

    def assemble(self, out: dict[str, torch.Tensor]) -> QuantizedTensor:
        return scale_min_tensor(out, self.bits, SUB, self.name)


def _by_superblock(v: torch.Tensor) -> torch.Tensor:
    """[sub-blocks] -> [8, super-blocks] (element-major, for make_qp_quants)."""
    return v.reshape(-1, N_SUB).t().contiguous()


def _round_sub_scales(scales: torch.Tensor, mins: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The reference rounding of sub-block scales and mins to 6 bits against the super-block maxima."""
    max_scale = positive_max(scales.reshape(-1, N_SUB), dim=1)
    max_min = positive_max(mins.reshape(-1, N_SUB), dim=1)
    inv_scale = torch.where(max_scale > 0, rdiv(63.0, torch.where(max_scale > 0, max_scale, 1.0)), 0.0)
    inv_min = torch.where(max_min > 0, rdiv(63.0, torch.where(max_min > 0, max_min, 1.0)), 0.0)
    ls = uint8_wrap(nearest_int(per_block(inv_scale, N_SUB) * scales)).clamp(max=63)
    lm = uint8_wrap(nearest_int(per_block(inv_min, N_SUB) * mins)).clamp(max=63)
    return ls, lm, fp16(max_scale / 63.0), fp16(max_min / 63.0)


Q4_K = AsymKGrid("Q4_K", nmax=15, bits=4, ref_search=(-1.0, 0.1, 20))
Q5_K = AsymKGrid("Q5_K", nmax=31, bits=5, ref_search=(-0.5, 0.1, 15))
