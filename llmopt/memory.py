"""Advice to the OS about pages that llmopt's tensors sit on (Linux madvise; a no-op elsewhere).

Two uses: dropping the clean file pages a memory-mapped source was read from, so a streamed model
does not stay resident in RSS (`ModelSource.release_pages`: the GGUF writer after each tensor,
`load_block` after each block), and asking for transparent huge pages for the runtime's contiguous
weight block (runtime/arena.py).
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

MADV_DONTNEED = 4
MADV_HUGEPAGE = 14


def madvise(start: int, length: int, advice: int) -> None:
    """Best-effort madvise(2) on [start, start + length); advice only, failures are ignored."""
    if not sys.platform.startswith("linux") or length <= 0:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), advice)
    except (OSError, AttributeError):
        pass


def release_mapped_files(root: Path) -> None:
    """Drop the resident pages of every mapping of a file at or under `root` (Linux).

    safetensors and GGUF sources read tensors through a map of the file, and every page read stays
    counted in RSS while the file is open, so a streaming reader calls this after each layer or
    tensor to keep resident memory to one at a time. The sources hand out copies and never write to
    their maps, so the pages are clean and are read back from the file when needed again."""
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


def return_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc malloc_trim; a no-op elsewhere).

    glibc serves allocations below its mmap threshold from the heap, and that threshold grows to the
    largest block freed so far (up to 32 MiB), so while a model is built tensor by tensor the freed
    temporaries become holes between the kept weights that stay resident: 1.6 GB of a 7B Q4_K_M
    load. Calling this after each tensor keeps resident memory at what is held."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None).malloc_trim(ctypes.c_size_t(0))
    except (OSError, AttributeError):
        pass


def available_memory() -> int:
    """Bytes of memory the system can give without swapping (Linux MemAvailable; else all of RAM)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
