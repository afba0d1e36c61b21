"""Advice to the OS about pages that llmopt's tensors sit on (Linux madvise; a no-op elsewhere).

Two uses: dropping the clean file pages a memory-mapped source was read from, so a streamed model
does not stay resident in RSS (the GGUF writer, and `load_block` for layer-at-a-time work), and
asking for transparent huge pages for the runtime's contiguous weight block (runtime/arena.py).
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

import torch

MADV_DONTNEED = 4
MADV_HUGEPAGE = 14
PAGE = 4096


def madvise(start: int, length: int, advice: int) -> None:
    """Best-effort madvise(2) on [start, start + length); advice only, failures are ignored."""
    if not sys.platform.startswith("linux") or length <= 0:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), advice)
    except (OSError, AttributeError):
        pass


def release_file_pages(t: torch.Tensor) -> None:
    """Drop from this process the file pages a memory-mapped source tensor was read from (Linux).

    safetensors and GGUF sources hand out tensors backed by a private or read-only map of the file;
    every page read stays resident (and counted in RSS) while the map is open, so a 13 GB model
    would end up wholly resident. The pages are clean (nothing writes to them), so MADV_DONTNEED only
    makes a later read fetch them again from the file. Anonymous memory is never touched."""
    if not sys.platform.startswith("linux") or t.numel() == 0:
        return
    start, end = t.data_ptr(), t.data_ptr() + t.untyped_storage().nbytes()
    first, last = -(-start // PAGE) * PAGE, end // PAGE * PAGE  # whole pages inside the tensor
    if last > first and _file_backed(first, last):
        madvise(first, last - first, MADV_DONTNEED)


def _file_backed(first: int, last: int) -> bool:
    """Whether [first, last) lies in one mapping of a file (per /proc/self/maps)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split()
                lo, hi = (int(v, 16) for v in fields[0].split("-"))
                if lo <= first and last <= hi:
                    return len(fields) >= 6 and fields[5].startswith("/") and fields[4] != "0"
    except OSError:
        pass
    return False


def release_mapped_files(root: Path) -> None:
    """Drop the resident pages of every read-only mapping of a file at or under `root` (Linux).

    safetensors copies each tensor out of its map, so the pages it read stay mapped and counted in
    RSS until the file is closed; a layer-at-a-time reader calls this after each layer so resident
    memory follows one layer, not the model. The sources never write to their maps (they hand out
    copies), so the pages are clean copies of the file and are read back from it when needed again."""
    if not sys.platform.startswith("linux"):
        return
    base = os.path.realpath(root)
    try:
        with open("/proc/self/maps") as maps:
            lines = maps.readlines()
    except OSError:
        return
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 6:
            continue
        path = fields[5].strip()
        if path == base or path.startswith(base + os.sep):
            lo, hi = (int(v, 16) for v in fields[0].split("-"))
            madvise(lo, hi - lo, MADV_DONTNEED)
