"""Faults for a child llmopt process, set up before its CLI runs:

    python -m tests.faults [--enospc-after BYTES --match TEXT] [--free BYTES] [--kill-after-blocks N]
                             [--data-room BYTES] -- ARGS...

runs `llmopt ARGS...` where files opened for writing whose path contains TEXT fail with ENOSPC
once BYTES bytes in all have gone to them (a disk that fills during the write), and where the file
system reports BYTES free (`--free`: what llmopt's check before the write sees), or where the
process kills itself with SIGKILL right after it has recorded N finished blocks (`--kill-after-blocks`:
kill -9 at a known moment of a calibrated run), or where the data segment may grow only BYTES past
what the process holds once llmopt and torch are imported (`--data-room`: RLIMIT_DATA, a memory
limit the check before work does not read, so the run meets it mid-way). Writes go through
Python file objects in llmopt's writers, so wrapping `open` reaches every byte they write.
"""

from __future__ import annotations

import argparse
import builtins
import errno
import io
import os
import shutil
import signal
import sys
from collections import namedtuple


class _Filling:
    """A file object whose writes fail with ENOSPC past a shared byte budget."""

    def __init__(self, raw, budget: list[int]):
        self._raw, self._budget = raw, budget

    def write(self, data) -> int:
        n = memoryview(data).nbytes
        if n > self._budget[0]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._budget[0] -= n
        return self._raw.write(data)

    def fileno(self) -> int:
        raise io.UnsupportedOperation("fileno")  # a writer that went around write() would escape the fault

    def __getattr__(self, name):
        return getattr(self._raw, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._raw.close()


def _fill_after(budget: int, match: str) -> None:
    left, real_open = [budget], builtins.open

    def open_(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        if any(c in mode for c in "wax+") and match in os.fsdecode(file if not isinstance(file, int) else ""):
            return _Filling(f, left)
        return f

    builtins.open = io.open = open_


def _kill_after_blocks(n: int) -> None:
    from llmopt.formats.resume import ResumeLog

    record, count = ResumeLog.record, [0]

    def record_then_die(self, result, progress) -> None:
        record(self, result, progress)
        count[0] += 1
        if count[0] == n:
            os.kill(os.getpid(), signal.SIGKILL)

    ResumeLog.record = record_then_die


def _limit_data(room: int) -> None:
    import resource

    import torch  # noqa: F401  (what every command holds before its work)

    with open("/proc/self/status") as f:
        held = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmData:"))
    resource.setrlimit(resource.RLIMIT_DATA, (held + room, resource.getrlimit(resource.RLIMIT_DATA)[1]))


def _report_free(free: int) -> None:
    usage = namedtuple("usage", "total used free")
    shutil.disk_usage = lambda path: usage(free * 2, free, free)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--enospc-after", type=int)
    ap.add_argument("--match", default="")
    ap.add_argument("--free", type=int)
    ap.add_argument("--kill-after-blocks", type=int)
    ap.add_argument("--data-room", type=int)
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    if a.enospc_after is not None:
        _fill_after(a.enospc_after, a.match)
    if a.free is not None:
        _report_free(a.free)
    if a.kill_after_blocks is not None:
        _kill_after_blocks(a.kill_after_blocks)
    from llmopt.cli.app import main

    if a.data_room is not None:
        _limit_data(a.data_room)

    sys.argv = ["llmopt", *a.args[a.args[:1] == ["--"]:]]
    sys.exit(main())
