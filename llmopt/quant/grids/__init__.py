"""GGUF types as grids: each maps a float weight (and optional importance vector) to a QuantizedTensor.

`GRIDS[type_name].quantize(weight[rows, cols], importance[cols] | None)` returns codes and the
type's raw fields in `aux` (fp16 super-scales, 6-bit sub-scales, ...), from which
`llmopt.formats.gguf.blocks` writes llama.cpp's bytes. F32/F16/BF16 are plain casts (`floats`).
"""

from __future__ import annotations

from typing import Protocol

import torch

from llmopt.errors import InputError
from llmopt.quant.grids import legacy, q2_k, q3_k, q4_k, q6_k
from llmopt.quant.tensor import QuantizedTensor


class Grid(Protocol):
    def quantize(self, weight: torch.Tensor, importance: torch.Tensor | None = None) -> QuantizedTensor: ...


GRIDS: dict[str, Grid] = {
    "Q8_0": legacy.Q8_0, "Q4_0": legacy.Q4_0, "Q4_1": legacy.Q4_1, "Q5_0": legacy.Q5_0, "Q5_1": legacy.Q5_1,
    "Q2_K": q2_k.Q2_K, "Q3_K": q3_k.Q3_K, "Q4_K": q4_k.Q4_K, "Q5_K": q4_k.Q5_K, "Q6_K": q6_k.Q6_K,
}  # fmt: skip


def quantize(type_name: str, weight: torch.Tensor, importance: torch.Tensor | None = None) -> QuantizedTensor:
    """Quantize a [rows, cols] weight onto GGML type `type_name` as llama.cpp's quantizer does."""
    grid = GRIDS.get(type_name)
    if grid is None:
        raise InputError(f"no grid for GGML type {type_name!r}; have {', '.join(GRIDS)}")
    return grid.quantize(weight, importance)
