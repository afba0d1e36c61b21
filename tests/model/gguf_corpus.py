"""A corpus of crafted GGUF containers, valid and invalid, written byte by byte (the `gguf` package's
writer cannot make the invalid ones). Each case is a name and the file's bytes; what each reader
says of it is the test's business (tests/model/test_container_verdicts.py)."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from llmopt.model.ggml_types import GGML_TYPES

U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
_FMT = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<B", U64: "<Q", I64: "<q",
        F64: "<d"}  # fmt: skip


def s(text: str | bytes) -> bytes:
    """A GGUF string: u64 length, then the bytes."""
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def kv(key: str | bytes, vtype: int, value) -> bytes:
    """One key/value pair: a scalar, a string, or (vtype ARR) an (element type, items) pair."""
    if vtype == STR:
        return s(key) + struct.pack("<I", STR) + s(value)
    if vtype == ARR:
        etype, items = value
        body = b"".join(s(v) if etype == STR else struct.pack(_FMT[etype], v) for v in items)
        return s(key) + struct.pack("<IIQ", ARR, etype, len(items)) + body
    return s(key) + struct.pack("<I", vtype) + struct.pack(_FMT[vtype], value)


@dataclass
class T:
    """A tensor info; `offset`/`nbytes` None means the correct ones for a valid layout."""

    name: str | bytes
    dims: tuple[int, ...]
    type_name: str = "F32"
    offset: int | None = None
    type_id: int | None = None

    def nbytes(self) -> int:
        row = GGML_TYPES[self.type_name]
        n = 1
        for d in self.dims:
            n *= d
        return max(n // row.block * row.nbytes, 0)


@dataclass
class G:
    """A GGUF file to build; every field a place to break it."""

    tensors: list[T] = field(default_factory=list)
    kvs: list[bytes] = field(default_factory=list)
    version: int = 3
    magic: bytes = b"GGUF"
    alignment: int = 32
    n_tensors: int | None = None  # the count written (default: len(tensors))
    n_kv: int | None = None
    cut: int | None = None  # keep only the first `cut` bytes (negative: drop that many)
    tail: bytes = b""  # bytes after the data
    unpadded_end: bool = False  # the last tensor's padding left off

    def build(self) -> bytes:
        n_t = len(self.tensors) if self.n_tensors is None else self.n_tensors
        n_kv = len(self.kvs) if self.n_kv is None else self.n_kv
        out = bytearray(self.magic + struct.pack("<I", self.version) + struct.pack("<QQ", n_t % 2**64, n_kv % 2**64))
        for item in self.kvs:
            out += item
        running = 0
        spans = []
        for t in self.tensors:
            size = t.nbytes()
            spans.append(size)
            offset = running if t.offset is None else t.offset
            type_id = GGML_TYPES[t.type_name].id if t.type_id is None else t.type_id
            out += s(t.name) + struct.pack("<I", len(t.dims)) + b"".join(struct.pack("<q", d) for d in t.dims)
            out += struct.pack("<i", type_id) + struct.pack("<Q", offset % 2**64)
            running += -(-size // self.alignment) * self.alignment
        if self.tensors:
            out += bytes(-len(out) % self.alignment)
            for i, size in enumerate(spans):
                if size > 1 << 24:
                    break  # a size no file here holds: the data stops
                out += bytes((7 * i + j) % 251 for j in range(min(size, 64))) + bytes(max(size - 64, 0))
                if not (self.unpadded_end and i == len(spans) - 1):
                    out += bytes(-size % self.alignment)
        out += self.tail
        if self.cut is not None:
            out = out[:self.cut]
        return bytes(out)


@dataclass
class Raw:
    """A file given as its bytes (for breaks the builder has no field for)."""

    data: bytes

    def build(self) -> bytes:
        return self.data


HEAD_1 = b"GGUF" + struct.pack("<IQQ", 3, 1, 0)  # version 3, one tensor, no metadata


def _valid() -> dict[str, G]:
    w = T("blk.0.attn_q.weight", (64, 4))
    cases = {
        "empty: no tensors, no metadata": G(),
        "metadata only": G(kvs=[kv("general.architecture", STR, "llama"), kv("general.name", STR, "x")]),
        "one F32 tensor": G([w]),
        "version 2": G([w], version=2),
        "three tensors in order": G([w, T("b", (64, 4)), T("c", (32,))]),
        "a 1-D tensor of 3 (padding inside the data)": G([T("a", (3,)), T("b", (64,))]),
        "0 dimensions (a scalar)": G([T("scalar", ())]),
        "a zero-element tensor": G([T("empty", (0, 4)), w]),
        "4 dimensions": G([T("a", (2, 3, 4, 5))]),
        "alignment 64 (u32)": G([T("a", (3,)), w], kvs=[kv("general.alignment", U32, 64)], alignment=64),
        "alignment 1": G([T("a", (3,)), T("b", (5,))], kvs=[kv("general.alignment", U32, 1)], alignment=1),
        "alignment 256": G([T("a", (3,)), w], kvs=[kv("general.alignment", U32, 256)], alignment=256),
        "a name of 63 bytes": G([T("n" * 63, (32,))]),
        "a non-UTF-8 string value": G(kvs=[kv("general.name", STR, b"\xff\xfe")]),
        "a non-UTF-8 tensor name": G([T(b"w\xff", (32,))]),
        "an empty string value": G(kvs=[kv("general.name", STR, "")]),
        "an empty array": G(kvs=[kv("a.list", ARR, (U32, []))]),
        "a bool of 2": G(kvs=[kv("a.flag", BOOL, 2)]),
        "an array of strings": G(kvs=[kv("tokens", ARR, (STR, ["a", "", "bc"]))]),
        "trailing bytes after the data": G([w], tail=b"junk" * 10),
        "the last tensor's padding missing": G([T("a", (3,))], unpadded_end=True),
        "more tensors than 2**8": G([T(f"t{i}", (1,)) for i in range(300)]),
    }
    for vtype, value in [(U8, 255), (I8, -1), (U16, 65535), (I16, -5), (U32, 7), (I32, -7), (F32, 1.5), (U64, 2**64 - 1),
                         (I64, -(2**63)), (F64, -0.25)]:  # fmt: skip
        cases[f"a scalar of type {vtype}"] = G(kvs=[kv(f"k.{vtype}", vtype, value)])
        cases[f"an array of type {vtype}"] = G(kvs=[kv(f"a.{vtype}", ARR, (vtype, [value, value]))])
    for name in ["F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q8_1", "Q2_K", "Q3_K", "Q4_K", "Q6_K", "Q8_K", "IQ2_XXS",
                 "IQ4_NL", "IQ4_XS", "I8", "I32", "I64", "F64", "TQ2_0", "MXFP4", "NVFP4", "Q1_0", "Q2_0"]:  # fmt: skip
        block = GGML_TYPES[name].block
        cases[f"a {name} tensor"] = G([T("w", (block * 2, 3), name), T("x", (block,), name)])
    return cases


def _invalid() -> dict[str, G | Raw]:
    w, v = T("w", (64, 4)), T("v", (64, 4))
    q = T("q", (32, 2), "Q4_0")  # 36 bytes: padded to 64
    align = lambda value, vtype=U32: [kv("general.alignment", vtype, value)]  # noqa: E731
    return {
        "bad magic": G([w], magic=b"GGUG"),
        "3 bytes": G(cut=3),
        "the header cut after the version": G(cut=8),
        "the header cut inside the counts": G(cut=20),
        "version 0": G(version=0),
        "version 1": G(version=1),
        "version 4": G(version=4),
        "version 3 in the other byte order": G(version=0x03000000),
        "version 0x10003": G(version=0x10003),
        "tensor count 2**63 (negative)": G(n_tensors=2**63),
        "tensor count 2**64 - 1": G(n_tensors=2**64 - 1),
        "key count 2**63": G(n_kv=2**63),
        "more keys counted than written": G(kvs=[kv("a", U32, 1)], n_kv=2),
        "more tensors counted than written": G([w], n_tensors=2),
        "an empty key": G(kvs=[kv("", U32, 1)]),
        "a duplicate key": G(kvs=[kv("general.name", STR, "a"), kv("general.name", STR, "b")]),
        "a duplicate key of another type": G(kvs=[kv("x", U32, 1), kv("x", F32, 1.0)]),
        "value type 13": G(kvs=[s("k") + struct.pack("<I", 13) + bytes(8)]),
        "value type 2**31": G(kvs=[s("k") + struct.pack("<I", 2**31) + bytes(8)]),
        "an array of arrays": G(kvs=[s("k") + struct.pack("<IIQ", ARR, ARR, 1) + struct.pack("<IQ", U8, 0)]),
        "an array of type 13": G(kvs=[s("k") + struct.pack("<IIQ", ARR, 13, 1) + bytes(8)]),
        "an array counting more items than the file": G(kvs=[s("k") + struct.pack("<IIQ", ARR, U32, 2**40) + bytes(8)]),
        "an array of 2**62 strings": G(kvs=[s("k") + struct.pack("<IIQ", ARR, STR, 2**62)]),
        "a string longer than the file": G(kvs=[s("k") + struct.pack("<I", STR) + struct.pack("<Q", 10**6) + b"abc"]),
        "a key longer than the file": G(kvs=[struct.pack("<Q", 2**63) + b"k"]),
        "the metadata cut mid-value": G(kvs=[kv("general.name", STR, "a long name")], cut=-4),
        "alignment 0": G([w], kvs=align(0)),
        "alignment 3": G([w], kvs=align(3)),
        "alignment 48": G([w], kvs=align(48)),
        "alignment as u64": G([w], kvs=align(32, U64)),
        "alignment as i32": G([w], kvs=align(32, I32)),
        "alignment as u16": G([w], kvs=align(32, U16)),
        "alignment as a string": G([w], kvs=[kv("general.alignment", STR, "32")]),
        "alignment as an array": G([w], kvs=[kv("general.alignment", ARR, (U32, [32]))]),
        "alignment 64 but data laid out for 32": G([T("a", (3,)), w], kvs=align(64)),
        "a name of 64 bytes": G([T("n" * 64, (32,))]),
        "a name of 300 bytes": G([T("n" * 300, (32,))]),
        "a duplicate tensor name": G([w, T("w", (64, 4))]),
        "5 dimensions": G([T("a", (1, 1, 1, 1, 2))]),
        "2**32 - 1 dimensions": Raw(HEAD_1 + s("a") + struct.pack("<I", 2**32 - 1) + struct.pack("<q", 2) * 4),
        "a negative dimension": G([T("a", (-4, 2))]),
        "a dimension of 2**63 - 1": G([T("a", (2**63 - 1, 2))]),
        "2**32 x 2**32 elements": G([T("a", (2**32, 2**32))]),
        "more elements than the file": G([T("a", (2**20, 2**20))]),
        "type 4 (removed)": G([T("a", (32,), type_id=4)]),
        "type 31 (removed Q4_0_4_4)": G([T("a", (32,), type_id=31)]),
        "type 43 (past the table)": G([T("a", (32,), type_id=43)]),
        "type 1000": G([T("a", (32,), type_id=1000)]),
        "type -1": G([T("a", (32,), type_id=-1)]),
        "Q4_0 rows of 16": G([T("a", (16, 2), "Q4_0")]),
        "Q4_K rows of 128": G([T("a", (128,), "Q4_K")]),
        "two tensors at offset 0 (aliased)": G([w, T("v", (64, 4), offset=0)]),
        "the second tensor's data before the first's": G([T("a", (64, 4), offset=1024), T("b", (64, 4), offset=0)]),
        "a gap between tensors": G([w, T("v", (64, 4), offset=1056)]),
        "the first tensor at offset 32": G([T("a", (64, 4), offset=32)]),
        "an offset off the alignment": G([w, T("v", (64, 4), offset=1028)]),
        "an unpadded offset": G([q, T("b", (32,), offset=36)]),
        "an overlapping offset": G([w, v, T("u", (64, 4), offset=1536)]),
        "an offset of 2**64 - 32": G([T("a", (8,), offset=2**64 - 32)]),
        "the data cut inside the last tensor": G([w, v], cut=-100),
        "the data cut inside the first tensor": G([w, v], cut=-1500),
        "the file ends where the data starts": G([w], cut=-1024),
        "the file ends before the data's alignment": G([T("a" * 5, (8,))], cut=-40),
        "the tensor infos cut": G([w, v], cut=-2100),
        "a tensor count of 1 and no tensor info": G(n_tensors=1),
        "a tensor name longer than the file": Raw(HEAD_1 + struct.pack("<Q", 2**40) + b"abc"),
    }


def cases() -> dict[str, bytes]:
    """Every case's bytes, valid ones first (a case's name says what it is)."""
    return {name: g.build() for name, g in {**_valid(), **_invalid()}.items()}
