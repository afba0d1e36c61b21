"""Q3_K: 256-element super-blocks of 16 sub-blocks of 16 with 6-bit signed scales: w = d·sc[j]·(q - 4).

The reference search is `make_q3_quants` per sub-block, then the scales are rounded to 6 bits
against the largest; with an importance matrix, `make_qx_quants` weighted by imatrix·sqrt(σ² + x²)
for both the sub-blocks and the sub-scales.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from llmopt.quant.grids.layout import QK_K, BlockGrid, importance_major, per_block, superblock_sum_x2
from llmopt.quant.grids.numerics import blocks_major, c_sqrt, first_absmax, fp16, nearest_int, rdiv, seq_sum
from llmopt.quant.grids.searches import make_q3_quants, make_qx_quants, requantize_rows
from llmopt.quantized_tensor import QuantizedTensor

SUB = 16
N_SUB = QK_K // SUB


class Q3KGrid(BlockGrid):
    uniform: ClassVar[bool] = True
    name = "Q3_K"
    block = QK_K
    bits = 3

    def chunk(self, w: torch.Tensor, importance: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        rows = w.shape[0]
        x = blocks_major(w, SUB)
        if importance is None:
            scales, L = make_q3_quants(x, 4)
            max_scale = first_absmax(scales.reshape(-1, N_SUB).t())
            nonzero = max_scale != 0
            iscale = rdiv(-32.0, torch.where(nonzero, max_scale, torch.ones_like(max_scale)))
            stored = nearest_int(per_block(iscale, N_SUB) * scales).clamp(-32, 31) + 32
            stored = torch.where(per_block(nonzero, N_SUB), stored, torch.zeros_like(stored))
            d = torch.where(nonzero, fp16(rdiv(1.0, iscale)), torch.zeros_like(iscale))
        else:
            sigma2 = 2 * superblock_sum_x2(w) / QK_K
            weights = importance_major(importance, rows, SUB) * c_sqrt(per_block(sigma2, N_SUB) + x * x)
            sw = seq_sum(weights)
            scales, L = make_qx_quants(x, 4, weights)
            d_block, stored = make_qx_quants(scales.reshape(-1, N_SUB).t().contiguous(), 32,
                                             sw.reshape(-1, N_SUB).t().contiguous())  # fmt: skip
            stored = stored.t().reshape(-1)
            d = fp16(d_block)
        dd = per_block(d, N_SUB) * (stored - 32)
        return {
            "codes": requantize_rows(x.t(), L.t(), dd, None, -4, 3, offset=4).reshape(rows, -1),
            "d": d.reshape(rows, -1).to(torch.float16),
            "sc": stored.reshape(rows, -1).to(torch.uint8),  # 6-bit, biased by 32
        }

    def assemble(self, out: dict[str, torch.Tensor]) -> QuantizedTensor:
        d = out["d"].to(torch.float32).repeat_interleave(N_SUB, dim=1)
        scales = d * (out["sc"].to(torch.float32) - 32)
        return QuantizedTensor(codes=out["codes"], scales=scales, bits=3, group_size=SUB, grid="Q3_K",
                               aux={"d": out["d"], "sc": out["sc"]})  # fmt: skip


Q3_K = Q3KGrid()
