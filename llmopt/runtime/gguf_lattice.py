"""The lattice i-quants (IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M) kept quantized in memory.

Each group of 8 (IQ2, IQ1) or 4 (IQ3) values is the index of a codebook point, with 8 sign bits per 8
values (IQ3_XXS/IQ2_XXS/IQ2_XS store 7 and the 8th evens the count) or, for IQ1, a shift of ±1/8, and one
scale per sub-block of 32 or 16 values. A module holds the file's own fields (the same bytes, split by
role: no memory beyond the file's, but IQ1_M's float16 d joined from its four scale words) and reads them
one way for both paths:

* `values` rebuilds W's rows (prefill's tiles, a tied embedding's lookup), bit for bit gguf's
  dequantizer: W = (d·f(ls)) · level · sign, or d·f(ls) · (level ± 1/8).
* `lattice_gemv`, compiled by inductor (gguf_gemv.bind_product), sums level · sign · x for a decode
  step without building W.

A point is looked up as one int32 of packed coordinates (`Lattice.kgrid`: 2 or 3 bits each), once per
group, and its levels come out by arithmetic (`Level`): inductor gathers one value at a time, so one
gather per 4 or 8 weights instead of one per weight. 4096x4096 from RAM, 2 threads: 3.3-5.4 ms, against
160-262 ms through gguf's numpy dequantizer and a dense product (benchmarks/decode_products.py
--numpy-tiles; docs/generate.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmopt.model.ggml_types import GGML_TYPES_BY_ID, GGMLQuantType
from llmopt.quant.grids.iq1 import IQ1_LATTICE
from llmopt.quant.grids.iq_lattice import (IQ2_S_LATTICE, IQ2_XS_LATTICE, IQ2_XXS_LATTICE, IQ3_S_LATTICE,
                                           IQ3_XXS_LATTICE)
from llmopt.quant.grids.lattice import Lattice
from llmopt.runtime.gguf_linear import SplitFieldLinear, block_field, split_names

Q = GGMLQuantType
QK = 256  # values per block


@dataclass(frozen=True)
class Level:
    """A coordinate's level l -> the value it reads back as: base + step·l + bump·[l is the last level]
    (llama.cpp's grids: IQ2 8, 25, 43; IQ3_XXS 4, 12, ..., 52, 62; IQ3_S 1, 3, ..., 15; IQ1 -1, 0, 1)."""

    base: int
    step: int
    bump: int
    last: int

    def __call__(self, c: torch.Tensor) -> torch.Tensor:
        v = c * self.step + self.base
        return v if not self.bump else v + (c == self.last).float() * self.bump


@dataclass(frozen=True)
class LatticeType:
    """What a type's fields mean: its codebook, how a level reads back, values per group and sub-block, and
    the sub-block scale d·(ls·mult + add)·post."""

    lattice: Lattice
    level: Level
    sub: int  # values per sub-block (one scale)
    mult: float
    add: float
    post: float
    parity: bool  # 7 sign bits stored per 8 values


def _level(lattice: Lattice, base: int, step: int, bump: int) -> Level:
    level = Level(base, step, bump, lattice.nlevels - 1)
    got = level(torch.arange(lattice.nlevels, dtype=torch.float32)).tolist()
    if got != list(lattice.levels):
        raise AssertionError(f"level arithmetic {got} is not the grid's {lattice.levels}")
    return level


_IQ2 = dict(mult=1.0, add=0.5, post=0.25, parity=True)
TYPES = {
    Q.IQ3_XXS: LatticeType(IQ3_XXS_LATTICE, _level(IQ3_XXS_LATTICE, 4, 8, 2), 32, 1.0, 0.5, 0.5, True),
    Q.IQ3_S: LatticeType(IQ3_S_LATTICE, _level(IQ3_S_LATTICE, 1, 2, 0), 32, 2.0, 1.0, 1.0, False),
    Q.IQ2_XXS: LatticeType(IQ2_XXS_LATTICE, _level(IQ2_XXS_LATTICE, 8, 17, 1), 32, **_IQ2),
    Q.IQ2_XS: LatticeType(IQ2_XS_LATTICE, _level(IQ2_XS_LATTICE, 8, 17, 1), 16, **_IQ2),
    Q.IQ2_S: LatticeType(IQ2_S_LATTICE, _level(IQ2_S_LATTICE, 8, 17, 1), 16, 1.0, 0.5, 0.25, False),
    Q.IQ1_S: LatticeType(IQ1_LATTICE, _level(IQ1_LATTICE, -1, 1, 0), 32, 2.0, 1.0, 1.0, False),
    Q.IQ1_M: LatticeType(IQ1_LATTICE, _level(IQ1_LATTICE, -1, 1, 0), 16, 2.0, 1.0, 1.0, False),
}
TABLES = {q: torch.tensor(t.lattice.kgrid, dtype=torch.int32) for q, t in TYPES.items()}  # the points, packed


def split_fields(qtype: GGMLQuantType, data: torch.Tensor) -> dict[str, torch.Tensor]:
    """Block bytes [out, bytes per row] -> the type's fields [out, blocks, ...] (ggml-common.h's block
    structs; IQ1_M's float16 d, spread over the top nibbles of its four scale words, joined here)."""
    b = data.reshape(data.shape[0], -1, GGML_TYPES_BY_ID[qtype].nbytes)
    u8, i16, i32, f16 = torch.uint8, torch.int16, torch.int32, torch.float16
    part = block_field  # (short: the offsets below read as ggml's structs)
    if qtype == Q.IQ3_XXS:
        return {"d": part(b, 0, 2, f16), "qs": part(b, 2, 66, u8, 8, 4, 2), "aux": part(b, 66, 98, i32, 8)}
    if qtype == Q.IQ2_XXS:  # per 32 values two uint32: the 4 point indices, then 4 x 7 sign bits and the scale
        words = part(b, 2, 66, u8, 8, 2, 4)
        return {"d": part(b, 0, 2, f16), "qs": words[..., 0, :].contiguous(),
                "aux": words[..., 1, :].clone(memory_format=torch.contiguous_format).view(i32)[..., 0]}
    if qtype == Q.IQ2_XS:
        # per 8 values a uint16 of 9 index bits and 7 sign bits, held as its two bytes: an int16 field
        # compiles to a loop inductor does not vectorize (4096x4096 from RAM: 18.6 ms against 2.8)
        qs = part(b, 2, 66, u8, 16, 2, 2)
        return {"d": part(b, 0, 2, f16), "lo": qs[..., 0], "hi": qs[..., 1], "scales": part(b, 66, 74, u8, 8)}
    if qtype == Q.IQ2_S:
        return {"d": part(b, 0, 2, f16), "qs": part(b, 2, 34, u8, 16, 2), "signs": part(b, 34, 66, u8, 16, 2),
                "qh": part(b, 66, 74, u8, 8), "scales": part(b, 74, 82, u8, 8)}
    if qtype == Q.IQ3_S:
        return {"d": part(b, 0, 2, f16), "qs": part(b, 2, 66, u8, 8, 4, 2), "qh": part(b, 66, 74, u8, 8),
                "signs": part(b, 74, 106, u8, 8, 4), "scales": part(b, 106, 110, u8, 4)}
    if qtype == Q.IQ1_S:  # qh: a uint16 per 32 values, held as its two bytes (as IQ2_XS's)
        qh = part(b, 34, 50, u8, 8, 2)
        return {"d": part(b, 0, 2, f16), "qs": part(b, 2, 34, u8, 8, 4), "qh": qh[..., 0], "qh_hi": qh[..., 1]}
    if qtype == Q.IQ1_M:
        scales = part(b, 48, 56, i16, 4)
        top = (scales.to(torch.int32) & 0xF000) >> torch.tensor([12, 8, 4, 0], dtype=torch.int32)
        d = (top[..., 0] | top[..., 1] | top[..., 2] | top[..., 3]).to(i16).view(f16)
        words = part(b, 48, 56, u8, 4, 2)  # (as bytes: see IQ2_XS)
        return {"d": d, "qs": part(b, 0, 32, u8, 16, 2), "qh": part(b, 32, 48, u8, 16), "sc": words[..., 0],
                "sc_hi": words[..., 1]}
    raise ValueError(f"{qtype.name} is not a lattice type")


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Bytes [..., n, L] of two 4-bit fields (low first) -> int32 [..., 2n, L]."""
    q = packed.to(torch.int32)
    return torch.stack([q & 15, (q >> 4) & 15], dim=-2).reshape(*q.shape[:-2], -1, q.shape[-1])


@dataclass
class Parts:
    """A block's fields read into what `values` multiplies, each [..., blocks, S, G, L] over S sub-blocks,
    G groups of 8 values in each and L rows (or a size-1 axis): the packed points of the group (one, or
    two of 4 coordinates), 8 sign bits, the shift (IQ1) and the sub-block scale [..., blocks, S, L]."""

    points: list[torch.Tensor]
    signs: torch.Tensor | None
    shift: torch.Tensor | None
    scale: torch.Tensor


def _sub_scale(t: LatticeType, d: torch.Tensor, ls: torch.Tensor) -> torch.Tensor:
    """d·(ls·mult + add)·post, in gguf's order: d [..., blocks, L], ls int32 [..., blocks, S, L]."""
    f = ls.float() * t.mult + t.add
    y = d.float()[..., None, :] * f
    return y if t.post == 1.0 else y * t.post


def read_parts(qtype: GGMLQuantType, f: dict[str, torch.Tensor], table: torch.Tensor) -> Parts:
    """The type's fields, each [..., blocks, *rest, L] (interleaved rows, or one row with a size-1 L) -> Parts."""
    t = TYPES[qtype]
    i32 = torch.int32

    def look(index: torch.Tensor) -> torch.Tensor:
        return table[index.long()]

    if qtype in (Q.IQ3_XXS, Q.IQ2_XXS):
        aux = f["aux"].to(i32)  # [.., blocks, 8, L]: 4 x 7 sign bits, then the scale in the top 4
        shifts = torch.arange(0, 28, 7, dtype=i32, device=aux.device).reshape(4, 1)
        signs = (aux[..., None, :] >> shifts) & 127  # [.., blocks, 8, 4, L]
        scale = _sub_scale(t, f["d"], (aux >> 28) & 15)
        qs = f["qs"].to(i32)
        points = [look(qs[..., 0, :]), look(qs[..., 1, :])] if qtype == Q.IQ3_XXS else [look(qs)]
        return Parts(points, signs, None, scale)
    if qtype in (Q.IQ2_XS, Q.IQ2_S):
        scale = _sub_scale(t, f["d"], _nibbles(f["scales"]))  # [.., blocks, 16, L]
        if qtype == Q.IQ2_XS:
            hi = f["hi"].to(i32)
            return Parts([look(f["lo"].to(i32) | ((hi & 1) << 8))], hi >> 1, None, scale)
        qh = f["qh"].to(i32)  # 2 high index bits per group, 4 groups a byte
        shifts = torch.arange(0, 8, 2, dtype=i32, device=qh.device).reshape(4, 1)
        high = ((qh[..., None, :] >> shifts) & 3).reshape(*qh.shape[:-2], 16, 2, qh.shape[-1])
        return Parts([look(f["qs"].to(i32) | (high << 8))], f["signs"].to(i32), None, scale)
    if qtype == Q.IQ3_S:
        qh = f["qh"].to(i32)  # [.., blocks, 8, L]: bit 2g + h of byte s is point (s, g, h)'s ninth bit
        shifts = torch.arange(8, dtype=i32, device=qh.device).reshape(4, 2, 1)
        high = (qh[..., None, None, :] >> shifts) & 1  # [.., blocks, 8, 4, 2, L]
        qs = f["qs"].to(i32) | (high << 8)
        scale = _sub_scale(t, f["d"], _nibbles(f["scales"]))  # [.., blocks, 8, L]
        return Parts([look(qs[..., 0, :]), look(qs[..., 1, :])], f["signs"].to(i32), None, scale)
    if qtype == Q.IQ1_S:
        # qh [.., blocks, 8, L]: 4 x 3 high index bits, the scale, the shift's sign
        qh = f["qh"].to(i32) | (f["qh_hi"].to(i32) << 8)
        shifts = torch.arange(0, 12, 3, dtype=i32, device=qh.device).reshape(4, 1)
        index = f["qs"].to(i32) | (((qh[..., None, :] >> shifts) & 7) << 8)
        shift = 0.125 - 0.25 * ((qh >> 15) & 1).float()  # [.., blocks, 8, L]
        return Parts([look(index)], None, shift[..., None, :], _sub_scale(t, f["d"], (qh >> 12) & 7))
    if qtype == Q.IQ1_M:
        nib = _nibbles(f["qh"]).reshape(*f["qh"].shape[:-1], 2, f["qh"].shape[-1])  # [.., blocks, 16, 2, L]
        index = f["qs"].to(i32) | ((nib & 7) << 8)
        shift = 0.125 - 0.25 * ((nib >> 3) & 1).float()
        # the scale words [.., blocks, 4, L]: 4 x 3 scale bits each (and d's nibble, read at load)
        sc = f["sc"].to(i32) | (f["sc_hi"].to(i32) << 8)
        shifts = torch.arange(0, 12, 3, dtype=i32, device=sc.device).reshape(4, 1)
        ls = ((sc[..., None, :] >> shifts) & 7).reshape(*sc.shape[:-2], 16, sc.shape[-1])
        return Parts([look(index)], None, shift, _sub_scale(t, f["d"], ls))
    raise ValueError(f"{qtype.name} is not a lattice type")


def group_values(qtype: GGMLQuantType, parts: Parts) -> list[torch.Tensor]:
    """The 8 values of each group (level·sign, or level + shift), unscaled: 8 tensors [..., blocks, S, G, L]."""
    t = TYPES[qtype]
    dims = t.lattice.dims
    mask = (1 << t.lattice.bits) - 1
    out = []
    for j in range(8):
        word = parts.points[j // dims]
        k = j % dims
        v = t.level(((word >> (t.lattice.bits * k)) & mask).float())
        if parts.signs is not None:
            bit = (parts.signs >> j) & 1 if j < 7 or not t.parity else _parity(parts.signs)
            v = v * (1 - 2 * bit.float())
        if parts.shift is not None:
            v = v + parts.shift
        out.append(v)
    return out


def _parity(s: torch.Tensor) -> torch.Tensor:
    """The parity of 7 stored sign bits: the 8th sign (ksigns_iq2xs evens the count of negatives)."""
    s = s ^ (s >> 4)
    s = s ^ (s >> 2)
    return (s ^ (s >> 1)) & 1


def values(qtype: GGMLQuantType, fields: dict[str, torch.Tensor], table: torch.Tensor) -> torch.Tensor:
    """Float32 W [rows, in] from the fields of some rows [rows, blocks, ...] and the type's `TABLES` entry (on the
    fields' device), bit for bit gguf's."""
    f = {k: v[..., None] for k, v in fields.items()}  # a size-1 lane axis
    parts = read_parts(qtype, f, table)
    g = torch.stack(group_values(qtype, parts), dim=-2)  # [rows, blocks, S, G, 8, 1]
    w = parts.scale[..., None, None, :] * g
    return w.reshape(w.shape[0], -1)


def lattice_gemv(x: torch.Tensor, kind: str, table: torch.Tensor, *fields: torch.Tensor) -> torch.Tensor:
    """x [in] times LatticeLinear's W (fields in `split_fields`'s order, interleaved: [B, blocks, ..., L])."""
    qtype = Q[kind]
    names = FIELD_NAMES[qtype]
    parts = read_parts(qtype, dict(zip(names, fields)), table)
    blocks = fields[0].shape[1]
    sub = TYPES[qtype].sub
    xs = x.reshape(blocks, QK // sub, sub // 8, 8, 1)
    inner = 0
    for j, v in enumerate(group_values(qtype, parts)):
        inner = inner + v * xs[:, :, :, j]
    return ((inner.sum(-2) * parts.scale).sum((1, 2))).reshape(-1)


FIELD_NAMES = split_names(split_fields, TYPES)


class LatticeLinear(SplitFieldLinear):
    """A lattice i-quant weight: the file's fields (`split_fields`), LANES rows interleaved."""

    gemv = staticmethod(lattice_gemv)
    split_fields = staticmethod(split_fields)
    values = staticmethod(values)
    table = staticmethod(TABLES.__getitem__)
    field_names = FIELD_NAMES
