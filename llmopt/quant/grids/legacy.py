"""The legacy 32-element block types: Q8_0, Q4_0, Q5_0 (symmetric) and Q4_1, Q5_1 (scale and min).

Without an importance matrix the arithmetic is the one of ggml's reference quantizers, as the `gguf`
package restates it (`gguf.quants`): the codes are byte-identical to `gguf.quants.quantize`. With
one, llama.cpp searches each block as its K-quants do (`make_qx_quants` for Q4_0/Q5_0,
`make_qkx3_quants` for Q4_1/Q5_1) with weights imatrix·sqrt(σ²_row + x²); Q8_0 ignores it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmopt.quant.grids.layout import BlockGrid
from llmopt.quant.grids.numerics import c_low_byte, c_max, c_min, c_sqrt, first_absmax, rdiv, seq_sum
from llmopt.quant.grids.searches import compiled_for, f32_array, qkx_rows, qx_rows
from llmopt.quantized_tensor import QuantizedTensor

QK = 32


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), rdiv(1.0, torch.where(d == 0, torch.ones_like(d), d)))


def _round_away(v: torch.Tensor) -> torch.Tensor:
    """C's roundf (half away from zero), computed exactly as gguf's np_roundf does."""
    a = v.abs()
    floored = torch.floor(a)
    return floored.add_(torch.floor(a.sub_(floored).mul_(2))).copysign_(v)


def _importance_weights(w: torch.Tensor, importance: torch.Tensor) -> torch.Tensor:
    """llama.cpp's legacy imatrix weights, row-major like w: importance[j]·sqrtf(σ² + x²), σ² = Σx²/n over
    each whole row in index order. One compiled pass on CPU (the searches that use it load numba anyway)."""
    if (kernels := compiled_for(w)) is not None:
        out = torch.empty(w.shape)
        kernels.row_importance_weights(f32_array(w), f32_array(importance), out.numpy())
        return out
    sigma2 = seq_sum((w * w).t().contiguous()) / w.shape[1]
    return importance.to(torch.float32)[None, :] * c_sqrt(sigma2[:, None] + w * w)


@dataclass(frozen=True)
class SymmetricGrid(BlockGrid):
    """Q4_0 / Q5_0: w = d·(q - 2^(bits-1)), d = -max/2^(bits-1) from the largest-magnitude value."""

    name: str
    bits: int
    block: int = QK

    def chunk(self, w: torch.Tensor, importance: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        rows = w.shape[0]
        half = 1 << (self.bits - 1)
        if importance is None and (kernels := compiled_for(w, if_loaded=True)) is not None:
            codes, d = torch.empty(w.shape, dtype=torch.uint8), torch.empty(w.numel() // QK)
            kernels.symmetric_rows(w.reshape(-1, QK).numpy(), half, codes.view(-1, QK).numpy(), d.numpy())
            return {"codes": codes, "d": d.to(torch.float16).reshape(rows, -1)}
        if importance is None:  # row-major [blocks, 32]: no transposes on this simple path
            x = w.reshape(-1, QK)
            d = first_absmax(x.t()) / -half
            q = c_low_byte(torch.trunc(x * _inverse(d)[:, None] + (half + 0.5))).clamp_(0, 2 * half - 1)
            return {"codes": q.reshape(rows, -1).to(torch.uint8), "d": d.to(torch.float16).reshape(rows, -1)}
        d, q = qx_rows(w.reshape(-1, QK), half, _importance_weights(w, importance).reshape(-1, QK))
        return {"codes": q.reshape(rows, -1).to(torch.uint8), "d": d.to(torch.float16).reshape(rows, -1)}

    def assemble(self, out: dict[str, torch.Tensor]) -> QuantizedTensor:
        scales = out["d"].to(torch.float32)
        return QuantizedTensor(codes=out["codes"], scales=scales, bits=self.bits, group_size=QK, grid=self.name,
                               aux={"d": out["d"]})  # fmt: skip


@dataclass(frozen=True)
class AffineGrid(BlockGrid):
    """Q4_1 / Q5_1: w = d·q + m with d = (max - min)/(2^bits - 1) and m = min."""

    name: str
    bits: int
    block: int = QK

    def chunk(self, w: torch.Tensor, importance: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        rows = w.shape[0]
        levels = (1 << self.bits) - 1
        if importance is None and (kernels := compiled_for(w, if_loaded=True)) is not None:
            q, d, m = torch.empty(w.shape, dtype=torch.uint8), torch.empty(w.numel() // QK), torch.empty(w.numel() // QK)
            kernels.affine_rows(w.reshape(-1, QK).numpy(), levels, q.view(-1, QK).numpy(), d.numpy(), m.numpy())
        elif importance is None:  # row-major [blocks, 32]
            x = w.reshape(-1, QK)
            mx, mn = c_max(x.t()), c_min(x.t())
            d = (mx - mn) / levels
            q = c_low_byte(torch.trunc((x - mn[:, None]) * _inverse(d)[:, None] + 0.5)).clamp_(0, levels).reshape(rows, -1)
            m = mn
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

    name: str = "Q8_0"
    block: int = QK
    bits: int = 8

    def chunk(self, w: torch.Tensor, importance: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        rows = w.shape[0]
        if (kernels := compiled_for(w, if_loaded=True)) is not None:
            codes, d = torch.empty(w.shape, dtype=torch.uint8), torch.empty(w.numel() // QK)
            kernels.q8_0_rows(w.reshape(-1, QK).numpy(), codes.view(-1, QK).numpy(), d.numpy())
            return {"codes": codes, "d": d.to(torch.float16).reshape(rows, -1)}
        x = w.reshape(-1, QK)
        d = x.abs().amax(dim=1) / 127
        q = c_low_byte(_round_away(x * _inverse(d)[:, None])).add_(128)
        return {"codes": q.reshape(rows, -1).to(torch.uint8), "d": d.to(torch.float16).reshape(rows, -1)}

    def assemble(self, out: dict[str, torch.Tensor]) -> QuantizedTensor:
        return QuantizedTensor(codes=out["codes"], scales=out["d"].to(torch.float32), bits=8, group_size=QK,
                               grid=self.name, aux={"d": out["d"]})  # fmt: skip


Q4_0 = SymmetricGrid("Q4_0", 4)
Q5_0 = SymmetricGrid("Q5_0", 5)
Q4_1 = AffineGrid("Q4_1", 4)
Q5_1 = AffineGrid("Q5_1", 5)
Q8_0 = Q8Grid()
