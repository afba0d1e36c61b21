"""GGML tensor types: block geometry and exact on-disk sizes.

Sizes come from llmopt/model/ggml_types.py (llama.cpp's type traits as data, checked equal to the
`gguf` package's `GGML_QUANT_SIZES`); `tensor_nbytes` is what `--dry-run` and `recommend` add up.
Nothing here imports `gguf` (numpy and its reader).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

from llmopt.errors import InputError, OptionError
from llmopt.model.ggml_types import GGML_TYPES, PARTS, GGMLQuantType, GGMLType


# The types llmopt writes: the float containers, and every block type that model/ggml_types.py's PARTS
# names a grid and a packer for (legacy, K-quants, i-quants, ternary, Q1_0/Q2_0, FP4), in id order.
FLOAT_TYPES = ("F32", "F16", "BF16")
WRITABLE_TYPES = FLOAT_TYPES + tuple(PARTS)


def ggml_info(type_name: str) -> GGMLType:
    """The table row of a type name such as "Q4_K" (case-insensitive)."""
    try:
        return GGML_TYPES[type_name.upper()]
    except KeyError:
        raise InputError(f"unknown GGML type {type_name!r}; llmopt writes: {', '.join(WRITABLE_TYPES)}") from None


def writable_type(type_name: str, option: str) -> str:
    """The canonical name of a type asked for by `option` (`tensor_types`, `output_tensor_type`), which
    must be one llmopt writes: a plan (and `--dry-run`) never promises a tensor the writer refuses."""
    name = ggml_info(type_name).name
    if name not in WRITABLE_TYPES:
        raise OptionError(f"<{option}> {type_name}: llmopt does not write {name} tensors; it writes {', '.join(WRITABLE_TYPES)}")
    return name


def ggml_type(type_name: str) -> GGMLQuantType:
    """The enum member for a type name (what gguf's writer takes: it writes the number)."""
    return GGMLQuantType[ggml_info(type_name).name]


@functools.cache
def block_geometry(type_name: str) -> tuple[int, int]:
    """(elements per block, bytes per block) of a GGML type (remembered: `recommend` asks it ~10^6 times)."""
    info = ggml_info(type_name)
    return info.block, info.nbytes


def is_quantized(type_name: str) -> bool:
    """True for block types (ggml_is_quantized): everything but the plain float/int containers."""
    return block_geometry(type_name)[0] > 1


def row_nbytes(type_name: str, row_length: int) -> int:
    """Bytes of one row of `row_length` elements (ggml_row_size); the row must fill whole blocks."""
    block, nbytes = block_geometry(type_name)
    if row_length % block:
        raise InputError(f"{type_name} needs rows that are a multiple of {block}, got {row_length}")
    return row_length // block * nbytes


def tensor_nbytes(type_name: str, shape: Sequence[int]) -> int:
    """Exact data bytes of a tensor of `shape` (HF orientation: the last dim is the row) in `type_name`."""
    if type(shape) is tuple and shape:  # the common case, remembered: planning asks for the same shapes per layer
        return _tensor_nbytes(type_name, shape)
    return _tensor_nbytes(type_name, tuple(int(d) for d in shape) or (1,))


@functools.lru_cache(maxsize=65536)
def _tensor_nbytes(type_name: str, shape: tuple[int, ...]) -> int:
    return math.prod(shape[:-1]) * row_nbytes(type_name, int(shape[-1]))


def aligned(n: int, alignment: int) -> int:
    """`n` rounded up to a multiple of `alignment`: what a tensor (or the header) takes in the file."""
    return (n + alignment - 1) // alignment * alignment


# The types the automatic mix may give a tensor, from the smallest; each is kept only where the row
# divides its block (`candidate_types`).
CANDIDATES: tuple[str, ...] = ("Q2_K", "Q3_K", "Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "F16")


def candidate_types(shape: Sequence[int], candidates: Sequence[str] = CANDIDATES) -> list[str]:
    """The candidate types whose block divides the row length of a tensor of HF `shape`."""
    return [t for t in candidates if shape[-1] % block_geometry(t)[0] == 0]
