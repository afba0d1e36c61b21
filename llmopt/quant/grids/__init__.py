"""Grids: every way llmopt can round a weight, behind one contract.

A grid is the set of values a quantized weight can take and how its parameters are stored: the
integer grid of GPTQ/AWQ checkpoints (`IntGrid`), or one GGUF type (Q4_0 ... Q8_0, Q2_K ... Q6_K,
IQ4_NL/IQ4_XS, IQ3_XXS/IQ3_S, IQ2_XXS/IQ2_XS/IQ2_S, IQ1_S/IQ1_M, Q1_0/Q2_0, TQ1_0/TQ2_0, MXFP4, NVFP4),
whose raw fields (fp16 super-scales, 6-bit sub-scales, ...) `llmopt.formats.gguf.blocks` packs
into llama.cpp's bytes. Every grid does three things:

- `quantize(weight, importance)`: round to nearest over the whole matrix (for the GGUF types
  exactly as llama.cpp's reference quantizers, importance matrix included);
- `choose(columns, importance)`: the parameters of one span of columns (`span(cols)` wide: a
  group, or a GGUF (super-)block), from the weights as they stand;
- `round(column, params, j)` / `value(codes, params, j)`: one column's codes with those parameters
  fixed, and what the codes stand for; `assemble_spans` collects the result.

Methods round onto whatever grid they are given: GPTQ's error feedback onto Q4_K is `gptq` with
`GRIDS["Q4_K"]`, not a separate code path. Which grid a GGML type has is written once, in its entry
of `llmopt.model.ggml_types.PARTS` (with its packer and dequantizer); `GRIDS` is built from it.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any, Protocol

import torch

from llmopt.errors import InputError
from llmopt.model.ggml_types import PARTS
from llmopt.quant.grids.integer import IntGrid
from llmopt.quantized_tensor import QuantizedTensor


class Grid(Protocol):
    name: str  # "int", or the GGML type name
    bits: int
    block: int  # row lengths must be a multiple of this

    def quantize(self, weight: torch.Tensor, importance: torch.Tensor | None = None) -> QuantizedTensor: ...

    def span(self, cols: int) -> int: ...

    def choose(self, w: torch.Tensor, importance: torch.Tensor | None = None) -> Any: ...

    def round(self, x: torch.Tensor, params: Any, j: int) -> torch.Tensor: ...

    def value(self, q: torch.Tensor, params: Any, j: int) -> torch.Tensor: ...

    def assemble_spans(self, codes: torch.Tensor, params: list[Any], g_idx: torch.Tensor | None = None) -> QuantizedTensor: ...


def _grid(ref: str) -> Any:
    """The grid a GGML type's row names ("module.NAME" in this package)."""
    module, name = ref.split(".")
    return getattr(import_module(f"{__name__}.{module}"), name)


GRIDS: dict[str, Any] = {name: _grid(parts.grid) for name, parts in PARTS.items()}  # every type llmopt writes, by GGML id


def grid_identity(grid: Grid) -> str:
    """What names a grid the same way in every process (a run's resume key): a GGML type's grid by its
    type name (one grid object per type; some hold tables whose repr is an address), any other grid
    (the integer grid) by its fields."""
    return grid.name if GRIDS.get(grid.name) is grid else repr(grid)


def gguf_grid(type_name: str) -> Any:
    """The grid of GGML type `type_name`."""
    grid = GRIDS.get(type_name)
    if grid is None:
        raise InputError(f"no grid for GGML type {type_name!r}; have {', '.join(GRIDS)}")
    return grid


def quantize(type_name: str, weight: torch.Tensor, importance: torch.Tensor | None = None) -> QuantizedTensor:
    """Quantize a [rows, cols] weight onto GGML type `type_name` as llama.cpp's quantizer does."""
    return gguf_grid(type_name).quantize(weight, importance)


__all__ = ["GRIDS", "Grid", "IntGrid", "gguf_grid", "quantize"]
