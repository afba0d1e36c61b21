"""A process's memory counters from /proc/PID/status (Linux), shared by the benchmarks that report RSS.

Peak RSS is read as VmHWM rather than ru_maxrss: Linux carries the parent's high-water mark over
fork+exec into a child's ru_maxrss, and the benchmark drivers often hold a model themselves."""

from __future__ import annotations

from pathlib import Path


def status_kib(pid: int | str = "self") -> dict[str, int]:
    """The kB fields of /proc/PID/status (VmHWM, RssAnon, RssFile, ...), {} once the process is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    fields = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if value.strip().endswith("kB"):
            fields[name] = int(value.split()[0])
    return fields
