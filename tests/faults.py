"""Faults for a child llmopt process, set up before its CLI runs:

    python -m tests.faults [--enospc-after BYTES --match TEXT] [--free BYTES] -- ARGS...

runs `llmopt ARGS...` where files opened for writing whose path contains TEXT fail with ENOSPC
once BYTES bytes in all have gone to them (a disk that fills during the write), and where the file
system reports BYTES free (`--free`: what llmopt's check before the write sees). Writes go through
Python file objects in llmopt's writers, so wrapping `open` reaches every byte they write.
"""

from __future__ import annotations

import argparse
import builtins
import errno
import io
import os
import shutil
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


def _report_free(free: int) -> None:
    usage = namedtuple("usage", "total used free")
    shutil.disk_usage = lambda path: usage(free * 2, free, free)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--enospc-after", type=int)
    ap.add_argument("--match", default="")
    ap.add_argument("--free", type=int)
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    if a.enospc_after is not None:
        _fill_after(a.enospc_after, a.match)
    if a.free is not None:
        _report_free(a.free)
    from llmopt.cli.app import main

    sys.argv = ["llmopt", *a.args[a.args[:1] == ["--"]:]]
    sys.exit(main())
