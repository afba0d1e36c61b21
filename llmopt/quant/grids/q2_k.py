"""Q2_K: 256-element super-blocks of 16 sub-blocks of 16 with 4-bit scale and min: w = d·sc·q - dmin·m.

The reference search is `make_qkx2_quants` minimising |error| weighted by |x| (levels 0..3), scales
and mins rounded to 4 bits against their maxima; with an importance matrix, `make_qkx3_quants`
weighted by imatrix·sqrt(σ² + x²) and `make_qp_quants` for the 4-bit scales and mins.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from llmopt.quant.grids.layout import QK_K, BlockGrid, importance_major, per_block, scale_min_fields, scale_min_tensor, superblock_sum_x2
from llmopt.quant.grids.numerics import blocks_major, c_sqrt, fp16, nearest_int, positive_max, rdiv, seq_sum, uint8_wrap
from llmopt.quant.grids.searches import make_qkx_quants, make_qp_quants
from llmopt.quantized_tensor import QuantizedTensor

SUB = 16
N_SUB = QK_K // SUB


class Q2KGrid(BlockGrid):
    uniform: ClassVar[bool] = True
    name = "Q2_K"
    block = QK_K
    bits = 2

    def chunk(self, w: torch.Tensor, importance: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        rows = w.shape[0]
        x = blocks_major(w, SUB)
        if importance is None:
            scales, mins, L = make_qkx_quants(x, x.abs(), 3, -0.5, 0.1, 15, use_mad=True)
            max_scale = positive_max(scales.reshape(-1, N_SUB), dim=1)
            max_min = positive_max(mins.reshape(-1, N_SUB), dim=1)
            has_scale, has_min = max_scale > 0, max_min > 0
            iscale = rdiv(15.0, torch.where(has_scale, max_scale, torch.ones_like(max_scale)))
            imin = rdiv(15.0, torch.where(has_min, max_min, torch.ones_like(max_min)))
            byte = uint8_wrap(nearest_int(per_block(iscale, N_SUB) * scales))
            byte = torch.where(per_block(has_scale, N_SUB), byte, torch.zeros_like(byte)).to(torch.int32)
            high = (nearest_int(per_block(imin, N_SUB) * mins).to(torch.int32) << 4) & 0xFF
            byte = torch.where(per_block(has_min, N_SUB), byte | high, byte)
            d = torch.where(has_scale, fp16(max_scale / 15.0), torch.zeros_like(max_scale))
            dmin = torch.where(has_min, fp16(max_min / 15.0), torch.zeros_like(max_min))
            sc, m = (byte & 0xF).to(torch.float32), (byte >> 4).to(torch.float32)
        else:
            sigma2 = superblock_sum_x2(w) / QK_K
            weights = importance_major(importance, rows, SUB) * c_sqrt(per_block(sigma2, N_SUB) + x * x)
            sw = seq_sum(weights)
            scales, mins, L = make_qkx_quants(x, weights, 3, -0.9, 0.05, 36, use_mad=False)
            sw_sb = sw.reshape(-1, N_SUB).t().contiguous()
            d_block, sc = make_qp_quants(scales.reshape(-1, N_SUB).t().contiguous(), 15, sw_sb)
            m_block, m = make_qp_quants(mins.reshape(-1, N_SUB).t().contiguous(), 15, sw_sb)
            sc, m = sc.t().reshape(-1), m.t().reshape(-1)
            d, dmin = fp16(d_block), fp16(m_block)
        return scale_min_fields(x.t(), L.t(), d, dmin, sc, m, 3, rows)

    def assemble(self, out: dict[str, torch.Tensor]) -> QuantizedTensor:
        return scale_min_tensor(out, 2, SUB, "Q2_K")


Q2_K = Q2KGrid()
