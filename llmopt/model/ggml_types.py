"""GGML tensor types: id, elements per block, bytes per block — llama.cpp's facts, as plain data.

The numbers are those of llama.cpp's `ggml_type` enum and its type traits (ggml/include/ggml.h,
ggml/src/ggml.c `type_traits`), which the `gguf` package repeats as `GGMLQuantizationType` and
`GGML_QUANT_SIZES`; tests/model/test_ggml_types.py checks that every row here equals the `gguf`
package's. They are kept here as data, not read from `gguf`, because importing `gguf` imports numpy
and its whole reader and writer (a quarter of a second), and `recommend` and the planners need only
these numbers: the CLI answers `recommend --mem 48` without ever importing them. The table also has
the types llama.cpp has and the `gguf` package (0.19) does not (Q2_0), checked against llama.cpp's own
type traits; `GGMLQuantType` is its enum, whose members equal gguf's `GGMLQuantizationType` members
as integers (same hashes: either serves as a key of the other's tables), and what readers and the
writer use, so a file with a Q2_0 tensor reads and writes like any other.
"""

from __future__ import annotations

from enum import IntEnum
from typing import NamedTuple


class GGMLType(NamedTuple):
    name: str
    id: int
    block: int  # elements per block (1 for plain float and integer containers)
    nbytes: int  # bytes per block


_ROWS = (
    ("F32", 0, 1, 4), ("F16", 1, 1, 2), ("Q4_0", 2, 32, 18), ("Q4_1", 3, 32, 20), ("Q5_0", 6, 32, 22),
    ("Q5_1", 7, 32, 24), ("Q8_0", 8, 32, 34), ("Q8_1", 9, 32, 40), ("Q2_K", 10, 256, 84), ("Q3_K", 11, 256, 110),
    ("Q4_K", 12, 256, 144), ("Q5_K", 13, 256, 176), ("Q6_K", 14, 256, 210), ("Q8_K", 15, 256, 292),
    ("IQ2_XXS", 16, 256, 66), ("IQ2_XS", 17, 256, 74), ("IQ3_XXS", 18, 256, 98), ("IQ1_S", 19, 256, 50),
    ("IQ4_NL", 20, 32, 18), ("IQ3_S", 21, 256, 110), ("IQ2_S", 22, 256, 82), ("IQ4_XS", 23, 256, 136),
    ("I8", 24, 1, 1), ("I16", 25, 1, 2), ("I32", 26, 1, 4), ("I64", 27, 1, 8), ("F64", 28, 1, 8),
    ("IQ1_M", 29, 256, 56), ("BF16", 30, 1, 2), ("TQ1_0", 34, 256, 54), ("TQ2_0", 35, 256, 66),
    ("MXFP4", 39, 32, 17), ("NVFP4", 40, 64, 36), ("Q1_0", 41, 128, 18), ("Q2_0", 42, 64, 18),
)  # fmt: skip

GGML_TYPES: dict[str, GGMLType] = {row[0]: GGMLType(*row) for row in _ROWS}
GGML_TYPES_BY_ID: dict[int, GGMLType] = {t.id: t for t in GGML_TYPES.values()}
GGMLQuantType = IntEnum("GGMLQuantType", [(row[0], row[1]) for row in _ROWS])
