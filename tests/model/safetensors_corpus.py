"""A corpus of crafted safetensors files, valid and invalid, written byte by byte: an 8-byte header
length, the JSON header, the data. Each case is a name and the file's bytes."""

from __future__ import annotations

import json
import struct

ITEM = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
        "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}  # fmt: skip


def layout(tensors: list[tuple[str, str, list[int]]]) -> tuple[dict, int]:
    """A valid header for (name, dtype, shape) tensors laid end to end, and the data's length."""
    header, end = {}, 0
    for name, dtype, shape in tensors:
        n = ITEM[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [end, end + n]}
        end += n
    return header, end


def file(header: object, data_len: int, *, raw: bytes | None = None, length: int | None = None, extra: int = 0,
         cut: int = 0, pad: bytes = b"") -> bytes:  # fmt: skip
    """The file's bytes: `raw` header text (else the JSON of `header`), the declared `length` (else the real
    one), `extra` bytes after the data, `cut` bytes dropped from the end."""
    text = (json.dumps(header).encode() if raw is None else raw) + pad
    out = struct.pack("<Q", len(text) if length is None else length) + text
    out += bytes(i % 251 for i in range(data_len)) + bytes(extra)
    return out[:len(out) - cut] if cut else out


def _two() -> tuple[dict, int]:
    return layout([("a", "F32", [4, 4]), ("b", "F16", [8])])


def _with(change) -> bytes:
    header, n = _two()
    change(header)
    return file(header, n)


def cases() -> dict[str, bytes]:
    two, n = _two()
    out = {
        "no tensors": file({}, 0),
        "two tensors": file(two, n),
        "metadata": file({"__metadata__": {"format": "pt", "x": ""}, **two}, n),
        "header padded with spaces": file(two, n, pad=b"   "),
        "keys listed out of offset order": file(dict(reversed(list(two.items()))), n),
        "a zero-size tensor": file(layout([("a", "F32", [0, 4]), ("b", "F32", [2])])[0], 8),
        "a scalar": file(*layout([("s", "F32", [])])),
        "four dimensions": file(*layout([("a", "F32", [1, 2, 3, 2])])),
    }
    for dtype in ITEM:
        out[f"dtype {dtype}"] = file(*layout([("t", dtype, [3, 2])]))
    out.update({
        "empty file": b"",
        "7 bytes": b"\x02\x00\x00\x00\x00\x00\x00",
        "header length 0": file(two, n, raw=b""),
        "header length past the end": file(two, n, length=10**6),
        "header length 2**63": file(two, n, length=2**63),
        "header length 100 MB + 1": file(two, n, length=100_000_001),
        "header not JSON": file(None, 0, raw=b"{not json"),
        "header not UTF-8": file(None, 0, raw=b'{"\xff": 1}'),
        "header a JSON array": file([], 0),
        "header a JSON number": file(None, 0, raw=b"42"),
        "header null": file(None, 0, raw=b"null"),
        "header starting with a space": file(two, n, raw=b" " + json.dumps(two).encode()),
        "the data cut by one byte": file(two, n, cut=1),
        "one byte after the data": file(two, n, extra=1),
        "a gap between tensors": _with(lambda h: h["b"].update(data_offsets=[68, 84])),
        "two tensors on the same bytes": file({"a": two["a"], "c": {**two["a"]}}, 64),
        "overlapping tensors": _with(lambda h: h["b"].update(data_offsets=[60, 76])),
        "end before begin": _with(lambda h: h["b"].update(data_offsets=[80, 64])),
        "offsets not matching the shape": _with(lambda h: h["b"].update(shape=[9])),
        "offsets past the data": _with(lambda h: h["b"].update(data_offsets=[64, 800])),
        "three offsets": _with(lambda h: h["b"].update(data_offsets=[64, 72, 80])),
        "offsets as strings": _with(lambda h: h["b"].update(data_offsets=["64", "80"])),
        "negative offset": _with(lambda h: h["a"].update(data_offsets=[-4, 64])),
        "no data_offsets": _with(lambda h: h["b"].pop("data_offsets")),
        "no dtype": _with(lambda h: h["b"].pop("dtype")),
        "no shape": _with(lambda h: h["b"].pop("shape")),
        "an unknown dtype": _with(lambda h: h["b"].update(dtype="F7")),
        "a lowercase dtype": _with(lambda h: h["b"].update(dtype="f16")),
        "a negative dimension": _with(lambda h: h["b"].update(shape=[-8])),
        "a fractional dimension": _with(lambda h: h["b"].update(shape=[8.5])),
        "a dimension as a string": _with(lambda h: h["b"].update(shape=["8"])),
        "a shape of 2**40 x 2**40": _with(lambda h: h["b"].update(shape=[2**40, 2**40])),
        "a shape of 2**64": _with(lambda h: h["b"].update(shape=[2**64])),
        "a tensor entry that is a list": _with(lambda h: h.update(b=[1, 2])),
        "metadata with a number value": file({"__metadata__": {"format": 1}, **two}, n),
        "metadata a list": file({"__metadata__": ["a"], **two}, n),
        "a duplicate tensor name": file(None, n, raw=(json.dumps(two)[:-1] + ', "a": ' + json.dumps(two["a"]) + "}").encode()),
    })
    return out
