"""The legacy 32-element block types: Q8_0, Q4_0, Q5_0 (symmetric) and Q4_1, Q5_1 (scale and min).

Without an importance matrix the arithmetic is the one of ggml's reference quantizers, as the `gguf`
package restates it (`gguf.quants`), in one compiled pass per chunk (`compiled.q8_0_rows`,
`symmetric_rows`, `affine_rows`): the codes are byte-identical to `gguf.quants.quantize`. With
one, llama.cpp searches each block as its K-quants do (`make_qx_quants` for Q4_0/Q5_0,
`make_qkx3_quants` for Q4_1/Q5_1) with weights imatrix·sqrt(σ²_row + x²); Q8_0 ignores it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from llmopt.quant.grids.layout import BlockGrid
from llmopt.quant.grids.searches import f32_array, kernels, qkx_rows, qx_rows
from llmopt.quantized_tensor import QuantizedTensor

QK = 32


def _importance_weights(w: torch.Tensor, importance: torch.Tensor) -> torch.Tensor:
    """llama.cpp's legacy imatrix weights, row-major like w: importance[j]·sqrtf(σ² + x²), σ² = Σx²/n over
    each whole row in index order (compiled.row_importance_weights)."""
    out = torch.empty(w.shape)
    kernels().row_importance_weights(f32_array(w), f32_array(importance), out.numpy())
    return out


@dataclass(frozen=True)
class SymmetricGrid(BlockGrid):
    """Q4_0 / Q5_0: w = d·(q - 2^(bits-1)), d = -max/2^(bits-1) from the largest-magnitude value."""

    uniform: ClassVar[bool] = True

    name: str
    bits: int
    block: int = QK

    def chunk(self, w: torch.Tensor, importance: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        rows = w.shape[0]
        half = 1 << (self.bits - 1)
        if importance is None:
            codes, d = torch.empty(w.shape, dtype=torch.uint8), torch.empty(w.numel() // QK)
            kernels().symmetric_rows(w.reshape(-1, QK).numpy(), half, codes.view(-1, QK).numpy(), d.numpy())
            return {"codes": codes, "d": d.to(torch.float16).reshape(rows, -1)}
        d, q = qx_rows(w.reshape(-1, QK), half, _importance_weights(w, importance).reshape(-1, QK))
        return {"codes": q.reshape(rows, -1).to(torch.uint8), "d": d.to(torch.float16).reshape(rows, -1)}

    def assemble(self, out: dict[str, torch.Tensor]) -> QuantizedTensor:
        scales = out["d"].to(torch.float32)
        return QuantizedTensor(codes=out["codes"], scales=scales, bits=self.bits, group_size=QK, grid=self.name,
                               aux={"d": out["d"]})  # fmt: skip


@dataclass(frozen=True)
class AffineGrid(BlockGrid):
    """Q4_1 / Q5_1: w = d·q + m with d = (max - min)/(2^bits - 1) and m = min."""

    uniform: ClassVar[bool] = True

    name: str
    bits: int
    block: int = QK

    def chunk(self, w: torch.Tensor, importance: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        rows = w.shape[0]
        levels = (1 << self.bits) - 1
        if importance is None:
            q, d, m = torch.empty(w.shape, dtype=torch.uint8), torch.empty(w.numel() // QK), torch.empty(w.numel() // QK)
            kernels().affine_rows(w.reshape(-1, QK).numpy(), levels, q.view(-1, QK).numpy(), d.numpy(), m.numpy())
        else:
            weights = _importance_weights(w, importance).reshape(-1, QK)
            d, the_min, q = qkx_rows(w.reshape(-1, QK), weights, levels, -0.9, 0.05, 36, use_mad=False)
            m, q = -the_min, q.reshape(rows, -1)
        return {
            "codes": q.to(torch.uint8),
            "d": d.to(torch.float16).reshape(rows, -1),
            "m": m.to(torch.float16).reshape(rows, -1),
        }

    def assemble(self, out: dict[str, torch.Tensor]) -> QuantizedTensor:
        return QuantizedTensor(
            codes=out["codes"], scales=out["d"].to(torch.float32), mins=-out["m"].to(torch.float32), bits=self.bits,
            group_size=QK, grid=self.name, aux={"d": out["d"], "m": out["m"]},
        )  # fmt: skip


@dataclass(frozen=True)
class Q8Grid(BlockGrid):
    """Q8_0: w = d·q, q in [-127, 127] rounded half away from zero, d = amax/127 (codes stored +128).
    llama.cpp ignores the importance matrix for Q8_0, and so do we."""

    uniform: ClassVar[bool] = True

    name: str = "Q8_0"
    block: int = QK
    bits: int = 8

    def chunk(self, w: torch.Tensor, importance: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        rows = w.shape[0]
        codes, d = torch.empty(w.shape, dtype=torch.uint8), torch.empty(w.numel() // QK)
        kernels().q8_0_rows(w.reshape(-1, QK).numpy(), codes.view(-1, QK).numpy(), d.numpy())
        return {"codes": codes, "d": d.to(torch.float16).reshape(rows, -1)}

    def assemble(self, out: dict[str, torch.Tensor]) -> QuantizedTensor:
        return QuantizedTensor(codes=out["codes"], scales=out["d"].to(torch.float32), bits=8, group_size=QK,
                               grid=self.name, aux={"d": out["d"]})  # fmt: skip


Q4_0 = SymmetricGrid("Q4_0", 4)
Q5_0 = SymmetricGrid("Q5_0", 5)
Q4_1 = AffineGrid("Q4_1", 4)
Q5_1 = AffineGrid("Q5_1", 5)
Q8_0 = Q8Grid()
