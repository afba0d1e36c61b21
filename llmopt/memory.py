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


def cgroup_memory_room(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """Bytes this process's memory cgroup still lets it allocate (its limit less what it uses, page
    cache that can be reclaimed not counted as used), or None where there is no limit (or no cgroup).
    cgroup v2's `memory.max` / `memory.current`; v1's `memory.limit_in_bytes` / `memory.usage_in_bytes`."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0" and not controllers:  # v2: one unified hierarchy
            room = _cgroup_room(Path(root) / path.lstrip("/"), "memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            room = _cgroup_room(Path(root) / "memory" / path.lstrip("/"), "memory.limit_in_bytes",
                                "memory.usage_in_bytes", "total_inactive_file")  # fmt: skip
        else:
            continue
        if room is not None:
            return room
    return None


def _cgroup_room(directory: Path, limit_file: str, usage_file: str, reclaimable: str) -> int | None:
    try:
        limit = (directory / limit_file).read_text().strip()
        usage = int((directory / usage_file).read_text())
    except (OSError, ValueError):
        return None
    if limit == "max" or not limit.isdigit() or int(limit) >= 1 << 60:  # v1 writes "no limit" as ~2**63
        return None
    cache = 0
    try:
        for line in (directory / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == reclaimable:
                cache = int(value)
    except (OSError, ValueError):
        pass
    return max(0, int(limit) - max(0, usage - cache))


def memory_budget() -> tuple[int, str]:
    """(bytes, where the number comes from): what the system can give (`available_memory`), or the
    room left under this process's cgroup limit when that is lower ("cgroup limit")."""
    system = available_memory()
    room = cgroup_memory_room()
    if room is not None and room < system:
        return room, "cgroup limit"
    return system, "available"


def memory_limits_text() -> str:
    """What bounds this process's memory, for an out-of-memory message: the room the system (or the
    cgroup) has now, and any ulimit on the address space or the data segment."""
    import resource

    room, where = memory_budget()
    parts = [f"{room / 1e9:.1f} GB {where} now"]
    for name, which in (("ulimit -v", resource.RLIMIT_AS), ("data limit", resource.RLIMIT_DATA)):
        soft, _ = resource.getrlimit(which)
        if soft != resource.RLIM_INFINITY:
            parts.append(f"{name} {soft / 1e9:.1f} GB")
    return ", ".join(parts)
