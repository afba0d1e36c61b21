"""Write safetensors shards one tensor at a time, so peak memory is one tensor, not one shard.

The format is an 8-byte little-endian header length, a JSON header giving every tensor's dtype,
shape and byte range, then the raw bytes in that order. Shapes and dtypes are known before any data
is produced, so the header is written first and each tensor's bytes are streamed after it.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPE_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int32: "I32",
               torch.int64: "I64", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
               torch.float8_e4m3fn: "F8_E4M3"}  # fmt: skip
ITEMSIZE = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2, torch.int32: 4, torch.int64: 8,
            torch.int16: 2, torch.int8: 1, torch.uint8: 1, torch.bool: 1, torch.float8_e4m3fn: 1}


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = ITEMSIZE[self.dtype]
        for d in self.shape:
            n *= d
        return n


def plan_shards(tensors: list[PlannedTensor], max_shard_bytes: int) -> list[list[PlannedTensor]]:
    """Group tensors, in order, into shards of at most `max_shard_bytes` (one tensor may exceed it)."""
    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def shard_file_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def _header(plan: list[PlannedTensor], metadata: dict[str, str] | None) -> bytes:
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for t in plan:
        header[t.name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # align the data section to 8 bytes, as the reference writer does
    return struct.pack("<Q", len(raw)) + raw


class ShardedWriter:
    """Shards written as tensors arrive, in plan order: `put(tensor)` for each planned tensor, then
    `close()` (which writes the index when there are several shards)."""

    def __init__(self, directory: Path, tensors: Iterable[PlannedTensor], max_shard_bytes: int,
                 metadata: dict[str, str] | None = None):  # fmt: skip
        self.directory = directory
        self.shards = plan_shards(list(tensors), max_shard_bytes)
        self.names = shard_file_names(len(self.shards))
        self.metadata = metadata
        self.order = [(i, t) for i, shard in enumerate(self.shards) for t in shard]
        self.done = 0
        self.file = None
        self.open_shard = -1

    @property
    def next(self) -> PlannedTensor | None:
        """The tensor `put` expects next (None when all are written)."""
        return self.order[self.done][1] if self.done < len(self.order) else None

    def put(self, tensor: torch.Tensor) -> None:
        shard, t = self.order[self.done]
        if tuple(tensor.shape) != t.shape or tensor.dtype != t.dtype:
            raise ValueError(f"{t.name}: produced {tuple(tensor.shape)} {tensor.dtype}, planned {t.shape} {t.dtype}")
        if shard != self.open_shard:
            self._close_file()
            self.file = (self.directory / self.names[shard]).open("wb")
            self.file.write(_header(self.shards[shard], self.metadata))
            self.open_shard = shard
        self.file.write(_tensor_bytes(tensor))
        self.done += 1

    def _close_file(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None

    def close(self) -> list[str]:
        """Finish the last shard and the index; returns the shard file names."""
        self._close_file()
        if self.done < len(self.order):
            raise RuntimeError(f"{self.next.name}: never written")  # type: ignore[union-attr]
        if len(self.shards) > 1:
            write_index(self.directory, self.shards, self.names)
        return self.names


def write_index(directory: Path, shards: list[list[PlannedTensor]], names: list[str]) -> None:
    total = sum(t.nbytes for shard in shards for t in shard)
    weight_map = {t.name: name for shard, name in zip(shards, names) for t in shard}
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    elif t.dtype == torch.float8_e4m3fn:  # numpy has no float8: its bytes
        t = t.view(torch.uint8)
    return memoryview(t.numpy()).cast("B")


def write_sharded(directory: Path, tensors: Iterable[PlannedTensor], produce: Callable[[PlannedTensor], torch.Tensor],
                  max_shard_bytes: int, metadata: dict[str, str] | None = None,
                  on_tensor: Callable[[PlannedTensor], None] | None = None) -> list[str]:
    """Write all shards, asking `produce` for each tensor in order; returns the shard file names."""
    writer = ShardedWriter(directory, tensors, max_shard_bytes, metadata)
    try:
        while (t := writer.next) is not None:
            writer.put(produce(t))
            if on_tensor:
                on_tensor(t)
    finally:
        writer._close_file()
    return writer.close()
