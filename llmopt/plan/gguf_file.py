"""The size of a whole GGUF file: header, metadata, tensor directory, alignment padding and data.

A GGUF file is what users download and what `--mem` is often compared to, and its metadata (mostly
the tokenizer) is a visible part of a small model's file. llama-quantize copies every key/value
of its input, sets `general.file_type` and `general.quantization_version` (both uint32) and drops the
split keys; every tensor's data is padded to the alignment (32 bytes unless general.alignment
says otherwise). So when the model is a GGUF file the metadata is measured exactly from it, and
otherwise estimated from the vocabulary.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from llmopt.formats.gguf.types import aligned, tensor_nbytes
from llmopt.plan.arch_tensors import PlannedTensors

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
    from llmopt.model.gguf_header import read_gguf  # gguf and numpy only when a file is read

    header = read_gguf(path)
    kept = sum(n for key, n in header.kv_bytes.items() if not (key.startswith(_DROPPED_PREFIX) or key in _U32_KEYS))
    return kept + sum(_kv_entry_bytes(k, 4) for k in _U32_KEYS), header.alignment


def tensor_directory(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """GGUF name -> (GGML type name, HF-orientation shape) of every tensor in a GGUF file."""
    from llmopt.model.gguf_header import read_gguf

    return {t.name: (t.tensor_type.name, tuple(reversed(t.shape))) for t in read_gguf(path).tensors}


def estimated_metadata_bytes(vocab_size: int) -> int:
    """Key/value bytes of a GGUF whose source file we do not have: tokenizer-dominated estimate."""
    return _META_FIXED_BYTES + _META_BYTES_PER_TOKEN * vocab_size


def tensor_info_bytes(name: str, ndim: int) -> int:
    """One tensor directory entry: name, dims, each dim, type, data offset."""
    return 8 + len(name.encode()) + 4 + 8 * ndim + 4 + 8


def gguf_file_bytes(tensors: PlannedTensors, type_counts: Mapping[tuple[str, tuple[int, ...]], int],
                    metadata_bytes: int, alignment: int = DEFAULT_ALIGNMENT) -> int:  # fmt: skip
    """Exact file size of a GGUF holding `tensors`, `type_counts[type, shape]` of them of each GGML type
    and shape (`WeightSize.type_counts`), and this much metadata."""
    data = sum(n * aligned(tensor_nbytes(type_name, shape), alignment) for (type_name, shape), n in type_counts.items())
    return aligned(HEADER_BYTES + metadata_bytes + tensors.once(_directory_bytes), alignment) + data


def _directory_bytes(tensors: PlannedTensors) -> int:
    return sum(tensor_info_bytes(t.gguf_name, len(t.shape)) for t in tensors)
