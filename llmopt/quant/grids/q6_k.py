"""Q6_K: 256-element super-blocks of 16 sub-blocks of 16 with signed 8-bit scales: w = d·sc[j]·(q - 32).

llama.cpp's reference chooses each sub-block's scale with `make_qx_quants` (x²-weighted, or
imatrix-weighted when one is given), rounds the scales to int8 against the largest one and
requantizes the sub-blocks with the stored scales.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from llmopt.quant.grids.layout import QK_K, BlockGrid, per_block
from llmopt.quant.grids.numerics import GROUP_MAX_EPS, first_absmax, fp16, nearest_int, rdiv
from llmopt.quant.grids.searches import qx_rows, requantize_rows
from llmopt.quantized_tensor import QuantizedTensor

SUB = 16
N_SUB = QK_K // SUB


class Q6KGrid(BlockGrid):
    uniform: ClassVar[bool] = True
    name = "Q6_K"
    block = QK_K
    bits = 6

    def chunk(self, w: torch.Tensor, importance: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        rows = w.shape[0]
        x = w.reshape(-1, SUB)  # sub-blocks by rows, a view of w
        qw = None if importance is None else importance.to(torch.float32).repeat(rows).reshape(-1, SUB)
        scales, L = qx_rows(x, 32, qw)
        by_sb = scales.reshape(-1, N_SUB).t()
        max_scale = first_absmax(by_sb)
        zero = max_scale.abs() < GROUP_MAX_EPS
        iscale = rdiv(-128.0, torch.where(zero, torch.ones_like(max_scale), max_scale))
        d = torch.where(zero, torch.zeros_like(iscale), fp16(rdiv(1.0, iscale)))
        sc = nearest_int(per_block(iscale, N_SUB) * scales).clamp(max=127)
        sc = torch.where(per_block(zero, N_SUB), torch.zeros_like(sc), sc)
        codes = requantize_rows(x, L, per_block(d, N_SUB) * sc, None, -32, 31, offset=32)
        if bool(zero.any()):
            codes[per_block(zero, N_SUB)] = 0  # an all-zero block is stored as zeros
        return {
            "codes": codes.reshape(rows, -1),
            "d": d.reshape(rows, -1).to(torch.float16),
            "sc": sc.reshape(rows, -1).to(torch.int8),
        }

    def assemble(self, out: dict[str, torch.Tensor]) -> QuantizedTensor:
        d = out["d"].to(torch.float32).repeat_interleave(N_SUB, dim=1)
        return QuantizedTensor(codes=out["codes"], scales=d * out["sc"].to(torch.float32), bits=6, group_size=SUB,
                               grid="Q6_K", aux={"d": out["d"], "sc": out["sc"]})  # fmt: skip


Q6_K = Q6KGrid()
