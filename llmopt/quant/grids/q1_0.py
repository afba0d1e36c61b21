"""Q1_0 and Q2_0: 1- and 2-bit values with one fp16 scale per block, and no search.

    Q1_0: 128-element blocks: fp16 d + one sign bit per value (18 bytes / 128, 1.125 bpw): w = ±d,
          d = mean |x| of the block, bit = x >= 0 (quantize_row_q1_0_ref in ggml-quants.c)
    Q2_0: 64-element blocks: fp16 d + 2 bits per value (18 bytes / 64, 2.25 bpw): w = (q - 1)·d, so the
          levels are -d, 0, d, 2d; d = max |x|, q = roundf(x/d) + 1 clamped to 0..3 (quantize_row_q2_0_ref)

llama.cpp's quantizers ignore an importance matrix for both; so do we. In the QuantizedTensor the codes
are the stored bits (`bits` 1 / 2) with float minimums: Q1_0 scales 2d and mins d (w = 2d·b - d), Q2_0
scales d and mins d (w = d·q - d); both are exactly ggml's dequantized values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmopt.quant.grids.layout import BlockGrid, BlockParams
from llmopt.quant.grids.numerics import blocks_major, inverse_or_zero, roundf, seq_sum
from llmopt.quantized_tensor import QuantizedTensor


@dataclass(frozen=True)
class Q1Grid(BlockGrid):
    name: str = "Q1_0"
    block: int = 128
    bits: int = 1

    def chunk(self, w: torch.Tensor, importance: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        rows = w.shape[0]
        d = seq_sum(blocks_major(w, self.block).abs()) / torch.tensor(float(self.block))  # Σ|x| in index order
        return {"codes": (w >= 0).to(torch.uint8), "d": d.to(torch.float16).reshape(rows, -1)}

    def assemble(self, out: dict[str, torch.Tensor]) -> QuantizedTensor:
        d = out["d"].to(torch.float32)
        return QuantizedTensor(codes=out["codes"], scales=d * 2.0, mins=d, bits=1, group_size=self.block,
                               grid=self.name, aux={"d": out["d"]})  # fmt: skip

    def round(self, x: torch.Tensor, p: BlockParams, j: int) -> torch.Tensor:
        return (x >= 0).to(torch.float32)  # the nearest of ±d, as llama.cpp's sign bit


@dataclass(frozen=True)
class Q2Grid(BlockGrid):
    name: str = "Q2_0"
    block: int = 64
    bits: int = 2

    def chunk(self, w: torch.Tensor, importance: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        rows = w.shape[0]
        x = w.reshape(-1, self.block)
        d = x.abs().amax(dim=1)
        v = x * inverse_or_zero(d)[:, None]  # ±inf/NaN where 1/d overflows (denormal blocks): C's (int) of those is
        q = torch.where(v.isfinite(), roundf(v) + 1.0, 0.0).clamp_(0, 3)  # INT_MIN, clamped to q = 0
        return {"codes": q.reshape(rows, -1).to(torch.uint8), "d": d.to(torch.float16).reshape(rows, -1)}

    def assemble(self, out: dict[str, torch.Tensor]) -> QuantizedTensor:
        d = out["d"].to(torch.float32)
        return QuantizedTensor(codes=out["codes"], scales=d, mins=d, bits=2, group_size=self.block, grid=self.name,
                               aux={"d": out["d"]})  # fmt: skip


Q1_0 = Q1Grid()
Q2_0 = Q2Grid()
