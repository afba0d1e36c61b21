"""The size of a whole GGUF file: header, metadata, tensor directory, alignment padding and data.

A GGUF file is what users download and what `--mem` is often compared to, and its metadata (mostly
the tokenizer) is a visible part of a small model's file. llama-quantize copies every key/value
of its input, sets `general.file_type` and `general.quantization_version` (both uint32) and drops the
split keys; every tensor's data is padded to the alignment (32 bytes unless general.alignment
says otherwise). So when the model is a GGUF file the metadata is measured exactly from it, and
otherwise estimated from the vocabulary.
"""

from __future__ import annotations

import struct
from pathlib import Path

from llmopt.errors import InputError

from llmopt.formats.gguf.types import tensor_nbytes
from llmopt.plan.arch_tensors import PlannedTensor

HEADER_BYTES = 4 + 4 + 8 + 8  # magic, version, tensor count, key/value count
DEFAULT_ALIGNMENT = 32
_U32_KEYS = ("general.file_type", "general.quantization_version")
_DROPPED_PREFIX = "split."
# Estimated metadata per vocabulary entry when no GGUF file is at hand: the token string (8-byte
# length + ~7 bytes), its type (4), a score (4, SentencePiece) or BPE merges (~17 bytes each);
# SmolLM2's real file measures 36 bytes per token.
_META_BYTES_PER_TOKEN = 36
_META_FIXED_BYTES = 4096  # architecture keys, names, chat template


def _kv_entry_bytes(key: str, value_bytes: int) -> int:
    return 8 + len(key.encode()) + 4 + value_bytes


def measured_metadata_bytes(path: Path) -> tuple[int, int]:
    """(key/value bytes after llama-quantize's edits, alignment) of an existing GGUF file."""
    return _walk(path, with_tensors=False)[:2]


def tensor_directory(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """GGUF name -> (GGML type name, HF-orientation shape) of every tensor in a GGUF file."""
    return _walk(path, with_tensors=True)[2]


def _walk(path: Path, with_tensors: bool) -> tuple[int, int, dict[str, tuple[str, tuple[int, ...]]]]:
    """Walk the key/value section (lengths only, values skipped: much faster than decoding a
    100k-entry token list) and optionally the tensor directory."""
    from gguf import GGMLQuantizationType

    with path.open("rb") as f:
        head = f.read(HEADER_BYTES)
        if len(head) < HEADER_BYTES or head[:4] != b"GGUF":
            raise InputError(f"{path}: not a GGUF file")
        n_tensors, n_kv = struct.unpack_from("<QQ", head, 8)
        reader = _Cursor(f)
        total, alignment = 0, DEFAULT_ALIGNMENT
        for _ in range(n_kv):
            start = reader.pos
            key = reader.string()
            vtype = reader.u32()
            if key == "general.alignment":
                alignment = reader.value_int(vtype)
            else:
                reader.skip_value(vtype)
            if not (key.startswith(_DROPPED_PREFIX) or key in _U32_KEYS):
                total += reader.pos - start
        tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
        for _ in range(n_tensors if with_tensors else 0):
            name = reader.string()
            dims = [reader.u64() for _ in range(reader.u32())]
            type_id = reader.u32()
            reader.u64()  # data offset
            tensors[name] = (GGMLQuantizationType(type_id).name, tuple(reversed(dims)))
    total += sum(_kv_entry_bytes(k, 4) for k in _U32_KEYS)
    return total, alignment, tensors


# GGUF value types: 0 u8, 1 i8, 2 u16, 3 i16, 4 u32, 5 i32, 6 f32, 7 bool, 8 string, 9 array,
# 10 u64, 11 i64, 12 f64 (gguf-py constants.GGUFValueType).
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_INT_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 10: "<Q", 11: "<q"}


class _Cursor:
    """Sequential reads over the key/value section, counting bytes."""

    def __init__(self, f):  # noqa: ANN001 - a binary file
        self.f, self.pos = f, HEADER_BYTES

    def read(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise InputError(f"{getattr(self.f, 'name', 'GGUF')}: truncated GGUF metadata")
        self.pos += n
        return data

    def u32(self) -> int:
        return struct.unpack("<I", self.read(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self.read(8))[0]

    def string(self) -> str:
        return self.read(self.u64()).decode(errors="replace")

    def value_int(self, vtype: int) -> int:
        if vtype not in _INT_FORMATS:
            raise InputError("GGUF general.alignment is not an integer")
        return struct.unpack(_INT_FORMATS[vtype], self.read(_SCALAR_BYTES[vtype]))[0]

    def skip_value(self, vtype: int) -> None:
        if vtype in _SCALAR_BYTES:
            self.read(_SCALAR_BYTES[vtype])
        elif vtype == 8:
            self.read(self.u64())
        elif vtype == 9:
            item, count = self.u32(), self.u64()
            if item in _SCALAR_BYTES:
                self.read(_SCALAR_BYTES[item] * count)
            else:
                for _ in range(count):
                    self.skip_value(item)
        else:
            raise InputError(f"GGUF metadata has an unknown value type {vtype}")


def estimated_metadata_bytes(vocab_size: int) -> int:
    """Key/value bytes of a GGUF whose source file we do not have: tokenizer-dominated estimate."""
    return _META_FIXED_BYTES + _META_BYTES_PER_TOKEN * vocab_size


def tensor_info_bytes(name: str, ndim: int) -> int:
    """One tensor directory entry: name, dims, each dim, type, data offset."""
    return 8 + len(name.encode()) + 4 + 8 * ndim + 4 + 8


def _pad(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def gguf_file_bytes(tensors: list[PlannedTensor], types: dict[str, str], metadata_bytes: int,
                    alignment: int = DEFAULT_ALIGNMENT) -> int:
    """Exact file size of a GGUF holding `tensors` with these GGML `types` and metadata."""
    directory = sum(tensor_info_bytes(t.gguf_name, len(t.shape)) for t in tensors)
    data = sum(_pad(tensor_nbytes(types[t.gguf_name], t.shape), alignment) for t in tensors)
    return _pad(HEADER_BYTES + metadata_bytes + directory, alignment) + data
