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

It is also the index of each type's knowledge: `PARTS` names, for every type llmopt writes, its grid
(the search), its block packer and its dequantizer where the `gguf` package has none. The tables those
layers dispatch on (`GRIDS`, `blocks.PACKERS`, `dequantize`'s own types) are built from these names,
and tests/model/test_ggml_types.py checks that every name resolves and that every written type's parts agree.
"""

from __future__ import annotations

from enum import IntEnum
from typing import NamedTuple


class GGMLType(NamedTuple):
    name: str
    id: int
    block: int  # elements per block (1 for plain float and integer containers)
    nbytes: int  # bytes per block


class TypeParts(NamedTuple):
    """Where llmopt keeps what it knows of a type it writes, named as data (this module imports none of
    them: the planner reads it without torch). (The module a kept-quantized weight of the type becomes
    is chosen by runtime/linear.py's REGISTRY, which reads this module, not the other way.)"""

    grid: str  # "module.NAME" in llmopt.quant.grids: its search (GRIDS)
    packer: str  # a function in llmopt.formats.gguf.blocks: its fields to llama.cpp's bytes (PACKERS)
    dequantizer: str = ""  # a function in llmopt.model.dequantize: its bytes to floats ("": the gguf package's)


_ROWS = (
    ("F32", 0, 1, 4), ("F16", 1, 1, 2), ("Q4_0", 2, 32, 18), ("Q4_1", 3, 32, 20), ("Q5_0", 6, 32, 22),
    ("Q5_1", 7, 32, 24), ("Q8_0", 8, 32, 34), ("Q8_1", 9, 32, 36), ("Q2_K", 10, 256, 84), ("Q3_K", 11, 256, 110),
    ("Q4_K", 12, 256, 144), ("Q5_K", 13, 256, 176), ("Q6_K", 14, 256, 210), ("Q8_K", 15, 256, 292),
    ("IQ2_XXS", 16, 256, 66), ("IQ2_XS", 17, 256, 74), ("IQ3_XXS", 18, 256, 98), ("IQ1_S", 19, 256, 50),
    ("IQ4_NL", 20, 32, 18), ("IQ3_S", 21, 256, 110), ("IQ2_S", 22, 256, 82), ("IQ4_XS", 23, 256, 136),
    ("I8", 24, 1, 1), ("I16", 25, 1, 2), ("I32", 26, 1, 4), ("I64", 27, 1, 8), ("F64", 28, 1, 8),
    ("IQ1_M", 29, 256, 56), ("BF16", 30, 1, 2), ("TQ1_0", 34, 256, 54), ("TQ2_0", 35, 256, 66),
    ("MXFP4", 39, 32, 17), ("NVFP4", 40, 64, 36), ("Q1_0", 41, 128, 18), ("Q2_0", 42, 64, 18),
)  # fmt: skip

PARTS: dict[str, TypeParts] = {  # every block type llmopt writes, in id order
    "Q4_0": TypeParts("legacy.Q4_0", "pack_q4_0"),
    "Q4_1": TypeParts("legacy.Q4_1", "pack_q4_1"),
    "Q5_0": TypeParts("legacy.Q5_0", "pack_q5_0"),
    "Q5_1": TypeParts("legacy.Q5_1", "pack_q5_1"),
    "Q8_0": TypeParts("legacy.Q8_0", "pack_q8_0"),
    "Q2_K": TypeParts("q2_k.Q2_K", "pack_q2_k"),
    "Q3_K": TypeParts("q3_k.Q3_K", "pack_q3_k"),
    "Q4_K": TypeParts("q4_k.Q4_K", "pack_q4_k"),
    "Q5_K": TypeParts("q4_k.Q5_K", "pack_q5_k"),
    "Q6_K": TypeParts("q6_k.Q6_K", "pack_q6_k"),
    "IQ2_XXS": TypeParts("iq_lattice.IQ2_XXS", "pack_iq2_xxs"),
    "IQ2_XS": TypeParts("iq_lattice.IQ2_XS", "pack_iq2_xs"),
    "IQ3_XXS": TypeParts("iq_lattice.IQ3_XXS", "pack_iq3_xxs"),
    "IQ1_S": TypeParts("iq1.IQ1_S", "pack_iq1_s"),
    "IQ4_NL": TypeParts("iq4.IQ4_NL", "pack_iq4_nl"),
    "IQ3_S": TypeParts("iq_lattice.IQ3_S", "pack_iq3_s"),
    "IQ2_S": TypeParts("iq_lattice.IQ2_S", "pack_iq2_s"),
    "IQ4_XS": TypeParts("iq4.IQ4_XS", "pack_iq4_xs"),
    "IQ1_M": TypeParts("iq1.IQ1_M", "pack_iq1_m"),
    "TQ1_0": TypeParts("ternary.TQ1_0", "pack_tq1_0"),
    "TQ2_0": TypeParts("ternary.TQ2_0", "pack_tq2_0"),
    "MXFP4": TypeParts("fp4.MXFP4", "pack_mxfp4"),
    "NVFP4": TypeParts("fp4.NVFP4", "pack_nvfp4"),
    "Q1_0": TypeParts("q1_0.Q1_0", "pack_q1_0", "q1_0"),
    "Q2_0": TypeParts("q1_0.Q2_0", "pack_q2_0", "q2_0"),
}  # fmt: skip

GGML_TYPES: dict[str, GGMLType] = {row[0]: GGMLType(*row) for row in _ROWS}
GGML_TYPES_BY_ID: dict[int, GGMLType] = {t.id: t for t in GGML_TYPES.values()}
GGMLQuantType = IntEnum("GGMLQuantType", [(row[0], row[1]) for row in _ROWS])
