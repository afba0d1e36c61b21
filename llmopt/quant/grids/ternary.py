"""TQ1_0 and TQ2_0: ternary weights (BitNet b1.58, TriLMs), w = d·t with t in {-1, 0, 1}.

One fp16 d per 256 values. llama.cpp's quantizer (quantize_row_tq1_0_ref / quantize_row_tq2_0_ref in
ggml-quants.c) takes d = max|x| of the block and t = round(x/d), half away from zero (lroundf), and
ignores an importance matrix; so do we. The types differ only in packing: TQ2_0 holds 2 bits a value
(66 bytes / 256 = 2.0625 bpw), TQ1_0 five values a byte in base 3 (54 bytes / 256 = 1.6875 bpw).

Codes in the QuantizedTensor are t + 2 (1..3, `bits` 2, symmetric): (code - 2)·d is the value.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmopt.quant.grids.layout import QK_K, BlockGrid, BlockParams
from llmopt.quant.grids.numerics import inverse_or_zero, roundf
from llmopt.quantized_tensor import QuantizedTensor

ZERO_CODE = 2  # the code of t = 0


@dataclass(frozen=True)
class TernaryGrid(BlockGrid):
    name: str
    block: int = QK_K
    bits: int = 2

    def chunk(self, w: torch.Tensor, importance: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        rows = w.shape[0]
        x = w.reshape(-1, self.block)
        d = x.abs().amax(dim=1)
        v = x * inverse_or_zero(d)[:, None]  # ±inf/NaN where 1/d overflows (denormal blocks): C gets
        t = torch.where(v.isfinite(), roundf(v), 0.0)  # lroundf = LONG_MIN, whose `int xi = ... + 1` is 1: t = 0
        return {"codes": t.add_(ZERO_CODE).reshape(rows, -1).to(torch.uint8),
                "d": d.to(torch.float16).reshape(rows, -1)}  # fmt: skip

    def assemble(self, out: dict[str, torch.Tensor]) -> QuantizedTensor:
        return QuantizedTensor(codes=out["codes"], scales=out["d"].to(torch.float32), bits=2, group_size=self.block,
                               grid=self.name, aux={"d": out["d"]})  # fmt: skip

    # error feedback: the nearest of -d, 0, d with the block's d fixed
    def round(self, x: torch.Tensor, p: BlockParams, j: int) -> torch.Tensor:
        a = p.scale[:, j // p.sub]
        return torch.round(x * inverse_or_zero(a)).clamp_(-1, 1).add_(ZERO_CODE)

    def value(self, q: torch.Tensor, p: BlockParams, j: int) -> torch.Tensor:
        return p.scale[:, j // p.sub] * (q - ZERO_CODE)


TQ1_0 = TernaryGrid("TQ1_0")
TQ2_0 = TernaryGrid("TQ2_0")
