"""Calibration activations kept between passes over a model: in memory up to a budget, then on disk.

A streamed backward pass (the automatic mix's Fisher pass) needs every block's input from the
forward pass again, in reverse order. For an 8B model at the default 32 x 512 tokens that is
33 x 268 MB, more than the one block the pass otherwise holds, so the tensors past `budget` bytes
go to files in a temporary directory (`TMPDIR`, or `directory`) and are read back when asked for;
the directory is removed on `close`. Values come back bit for bit (raw float32 bytes).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch

DEFAULT_BUDGET = 1 << 30  # bytes kept in memory before spilling to disk


class ActivationStore:
    """`put(key, tensor)` / `get(key)` of tensors (returned on the CPU); the first `budget` bytes stay in memory."""

    def __init__(self, budget: int = DEFAULT_BUDGET, directory: str | Path | None = None):
        self.budget = budget
        self.directory = directory
        self._memory: dict[object, torch.Tensor] = {}
        self._files: dict[object, tuple[Path, tuple[int, ...], torch.dtype]] = {}
        self._held = 0
        self._tmp: tempfile.TemporaryDirectory | None = None

    @property
    def spilled(self) -> bool:
        """Whether any tensor went to disk."""
        return bool(self._files)

    def put(self, key: object, tensor: torch.Tensor) -> None:
        self.drop(key)
        t = tensor.detach().to("cpu").contiguous()
        if self._held + t.nbytes <= self.budget:
            self._memory[key] = t  # kept as given (no copy): callers do not change it in place afterwards
            self._held += t.nbytes
            return
        if self._tmp is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="llmopt-activations-", dir=self.directory)
        path = Path(self._tmp.name) / f"{len(self._files)}-{abs(hash(key))}.bin"
        t.reshape(-1).view(torch.uint8).numpy().tofile(path)  # raw bytes: any dtype, bit for bit
        self._files[key] = (path, tuple(t.shape), t.dtype)

    def get(self, key: object) -> torch.Tensor:
        if key in self._memory:
            return self._memory[key]
        path, shape, dtype = self._files[key]
        return torch.from_numpy(np.fromfile(path, dtype=np.uint8)).view(dtype).reshape(shape)

    def drop(self, key: object) -> None:
        t = self._memory.pop(key, None)
        if t is not None:
            self._held -= t.nbytes
        entry = self._files.pop(key, None)
        if entry is not None:
            entry[0].unlink(missing_ok=True)

    def close(self) -> None:
        self._memory.clear()
        self._files.clear()
        self._held = 0
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> ActivationStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
