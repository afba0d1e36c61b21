"""The types whose value is a scale times a small code read from a few bits (TQ1_0, TQ2_0, Q1_0, Q2_0, MXFP4,
NVFP4) kept quantized in memory.

A module holds the file's own fields (the same bytes, split by role; FP4's nibbles renumbered in level
order) and reads them one way for both paths, as gguf_lattice.py does: `values` rebuilds W's rows bit for
bit gguf's dequantizer (scale · code), and `code_gemv`, compiled by inductor (gguf_gemv.bind_product),
sums code · x per scale for a decode step. Codes come out by arithmetic on masked bits, never by a
table: TQ1_0's base-3 digits as ggml reads them (the byte times 3^k, wrapped to 8 bits, times 3, over
256), FP4's levels as a rounded polynomial of their rank (gguf_gemv.polynomial_levels, as IQ4's). The
scales that are bytes (MXFP4's E8M0, NVFP4's UE4M3) are looked up in a 256-entry table of the
quantizer's own decoding (quant/grids/fp4.py), once per 32 or 16 values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmopt.model.ggml_types import GGML_TYPES_BY_ID, GGMLQuantType
from llmopt.quant.grids.codebooks import FP4_VALUES
from llmopt.quant.grids.fp4 import half_scale, ue4m3_half
from llmopt.runtime.gguf_gemv import bit_field, level_polynomial, polynomial_levels
from llmopt.runtime.gguf_linear import SplitFieldLinear, block_field, split_names

Q = GGMLQuantType
I32 = torch.int32
BYTE_SCALES = {Q.MXFP4: half_scale(torch.arange(256)), Q.NVFP4: ue4m3_half(torch.arange(256))}
NO_TABLE = torch.zeros(1)  # (the float16 scales need none)

FP4_SORTED = tuple(sorted(FP4_VALUES))  # -12 .. 12, both zeros
FP4_POLYNOMIAL = level_polynomial(FP4_SORTED, degree=5)
# each FP4 nibble's index in FP4_SORTED (its zeros in order), for both nibbles of a byte: the fields hold
# the sorted indices, whose levels are polynomial_levels' (a mask and 7 float operations a value; by the
# sign bit and magnitude arithmetic, about twice as many: MXFP4 4096x4096 from RAM, 2 threads, 3.4 ms
# against 2.1)
_RANK = torch.tensor(sorted(range(16), key=lambda i: (FP4_VALUES[i], i))).argsort().to(torch.uint8)
SORTED_NIBBLES = _RANK[torch.arange(256) & 15] | (_RANK[torch.arange(256) >> 4] << 4)


def fp4_levels(codes: torch.Tensor, unit: int = 1) -> torch.Tensor:
    """The FP4 level of each sorted index (SORTED_NIBBLES), from codes `unit` times the index."""
    return polynomial_levels(codes, FP4_POLYNOMIAL, unit)


def _view(b: torch.Tensor, start: int, stop: int, *shape: int) -> torch.Tensor:
    return block_field(b, start, stop, torch.uint8, *shape)


def _half(b: torch.Tensor, at: int) -> torch.Tensor:
    return block_field(b, at, at + 2, torch.float16)


def table_of(qtype: GGMLQuantType) -> torch.Tensor:
    """The type's scale table (MXFP4, NVFP4), or a placeholder for the float16 scales."""
    return BYTE_SCALES.get(qtype, NO_TABLE)


def split_fields(qtype: GGMLQuantType, data: torch.Tensor) -> dict[str, torch.Tensor]:
    """Block bytes [out, bytes per row] -> the type's fields [out, blocks, ...] (ggml-common.h's structs)."""
    b = data.reshape(data.shape[0], -1, GGML_TYPES_BY_ID[qtype].nbytes)
    if qtype == Q.TQ2_0:
        return {"qs": _view(b, 0, 64, 1, 2, 32), "d": _half(b, 64)}
    if qtype == Q.TQ1_0:
        return {"qs0": _view(b, 0, 32, 1, 32), "qs1": _view(b, 32, 48, 1, 16), "qh": _view(b, 48, 52, 1, 4),
                "d": _half(b, 52)}
    if qtype in (Q.Q1_0, Q.Q2_0):
        return {"d": _half(b, 0), "qs": _view(b, 2, 18, 1, 16)}
    if qtype == Q.MXFP4:
        return {"e": _view(b, 0, 1, 1), "qs": SORTED_NIBBLES[_view(b, 1, 17, 1, 16).long()]}
    if qtype == Q.NVFP4:
        return {"sc": _view(b, 0, 4, 4), "qs": SORTED_NIBBLES[_view(b, 4, 36, 4, 8).long()]}
    raise ValueError(f"{qtype.name} has no code layout here")


@dataclass
class Segment:
    """Consecutive values of each scale group: `pieces` [..., blocks, S, *shape, L] that stack at `dim` (counted
    from the end, the lanes last) into the values in order."""

    pieces: list[torch.Tensor]
    dim: int


def _trits(q: torch.Tensor, digits: int) -> list[torch.Tensor]:
    """TQ1_0's base-3 digits of each byte, -1 for 0 (ggml: ((uint8(q · 3^k)) · 3) >> 8, less 1)."""
    q = q.to(I32)
    return [(((q * 3**k) & 255) * 3 >> 8).float() - 1 for k in range(digits)]


def read(qtype: GGMLQuantType, f: dict[str, torch.Tensor], table: torch.Tensor) -> tuple[list[Segment], torch.Tensor]:
    """The type's fields, each [..., blocks, *rest, L] -> its value segments and the scales [..., blocks, S, L]."""
    if qtype == Q.TQ2_0:  # value 128 h + 32 s + l: bits 2s of byte 32 h + l, less 1
        return [Segment([bit_field(f["qs"], 2, s) - 1 for s in range(4)], -3)], f["d"].float()[..., None, :]
    if qtype == Q.TQ1_0:  # 160 values from 32 bytes (5 digits), 80 from 16, 16 from 4 (4 digits)
        segments = [Segment(_trits(f["qs0"], 5), -3), Segment(_trits(f["qs1"], 5), -3),
                    Segment(_trits(f["qh"], 4), -3)]  # fmt: skip
        return segments, f["d"].float()[..., None, :]
    if qtype == Q.Q1_0:  # value j: bit j % 8 of byte j / 8, ±1
        return [Segment([bit_field(f["qs"], 1, t) * 2 - 1 for t in range(8)], -2)], f["d"].float()[..., None, :]
    if qtype == Q.Q2_0:  # value j: bits 2 (j % 4) of byte j / 4, less 1
        return [Segment([bit_field(f["qs"], 2, s) - 1 for s in range(4)], -2)], f["d"].float()[..., None, :]
    if qtype == Q.MXFP4:  # values 0..15 the low nibbles, 16..31 the high ones
        pieces = [fp4_levels(f["qs"] & 15 << 4 * h, 16**h) for h in range(2)]
        return [Segment(pieces, -3)], table[f["e"].long()]
    if qtype == Q.NVFP4:  # per 16 values: the low nibbles of 8 bytes, then their high ones
        pieces = [fp4_levels(f["qs"] & 15 << 4 * h, 16**h) for h in range(2)]
        return [Segment(pieces, -3)], table[f["sc"].long()]
    raise ValueError(f"{qtype.name} has no code layout here")


def values(qtype: GGMLQuantType, fields: dict[str, torch.Tensor], table: torch.Tensor) -> torch.Tensor:
    """Float32 W [rows, in] from the fields of some rows [rows, blocks, ...] and the type's `table_of` (on the
    fields' device), bit for bit gguf's."""
    segments, scale = read(qtype, {k: v[..., None] for k, v in fields.items()}, table)
    codes = torch.cat([torch.stack(s.pieces, dim=s.dim).flatten(3, -2) for s in segments], dim=3)  # [n, blocks, S, v]
    return (scale[..., None, :] * codes + 0.0).reshape(codes.shape[0], -1)  # (+ 0.0: a rounded -0 level is +0)


def code_gemv(x: torch.Tensor, kind: str, table: torch.Tensor, *fields: torch.Tensor) -> torch.Tensor:
    """x [in] times CodeLinear's W (fields in `split_fields`'s order, interleaved: [B, blocks, ..., L])."""
    qtype = Q[kind]
    segments, scale = read(qtype, dict(zip(FIELD_NAMES[qtype], fields)), table)
    n, blocks, groups = scale.shape[0], scale.shape[1], scale.shape[2]
    xb = x.reshape(blocks, groups, -1)
    inner, at = 0, 0
    for s in segments:
        piece = s.pieces[0].shape[3:-1]
        stacked = list(piece)
        stacked.insert(len(stacked) + s.dim + 2, len(s.pieces))
        size = len(s.pieces) * piece.numel()
        xs = xb[:, :, at:at + size].reshape(blocks, groups, *stacked, 1)
        for i, p in enumerate(s.pieces):
            inner = inner + (p * xs.select(s.dim, i)).sum(tuple(range(3, p.dim() - 1)))
        at += size
    return (inner * scale).sum((1, 2)).reshape(-1)


TYPES = (Q.TQ1_0, Q.TQ2_0, Q.Q1_0, Q.Q2_0, Q.MXFP4, Q.NVFP4)
FIELD_NAMES = split_names(split_fields, TYPES)


class CodeLinear(SplitFieldLinear):
    """A weight of one of `TYPES`: the file's fields (`split_fields`), LANES rows interleaved."""

    gemv = staticmethod(code_gemv)
    split_fields = staticmethod(split_fields)
    values = staticmethod(values)
    table = staticmethod(table_of)
    field_names = FIELD_NAMES
