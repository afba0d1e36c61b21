"""Outputs appear whole or not at all: write under a temporary name beside the target, then rename.

`check_output` is the one "may I write here?" rule (refused when the target exists, unless
`force`; an empty folder counts as free). `AtomicDir` / `AtomicFile` hold the temporary name for a
writer that works in steps (a sink fed block by block); `atomic_output_dir` / `atomic_output_file`
wrap them for code that writes in one go.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

from llmopt.errors import InputError, OptionError


def check_output(target: Path, force: bool, directory: bool = False) -> Path:
    """The resolved target, or an error if writing it would replace something without `force`."""
    target = Path(target).expanduser().resolve()
    if target.exists():
        if directory and not target.is_dir():
            raise InputError(f"{target}: exists and is not a directory")
        if not directory and target.is_dir():
            raise InputError(f"{target}: is a directory")
        free = directory and not any(target.iterdir())
        if not force and not free:
            raise OptionError(f"{target}: already exists (use <force> to replace it)")
    return target


class AtomicDir:
    """A fresh temporary folder next to `target` (`.tmp`); `commit()` makes it `target`, `discard()` removes it."""

    def __init__(self, target: Path, force: bool = False):
        self.target = check_output(target, force, directory=True)
        parent = _make_parent(self.target)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.target.name}.tmp-", dir=parent))
        self.tmp.chmod(0o777 & ~_umask())  # mkdtemp makes it private; the result should look like mkdir's

    def commit(self) -> Path:
        parent = self.target.parent
        if self.target.exists():
            trash = Path(tempfile.mkdtemp(prefix=f".{self.target.name}.old-", dir=parent))
            os.replace(self.target, trash / self.target.name)
            os.replace(self.tmp, self.target)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(self.tmp, self.target)
        return self.target

    def discard(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


class AtomicFile:
    """A temporary file next to `target` (`.tmp`); `commit()` renames it to `target`, `discard()` removes it."""

    def __init__(self, target: Path, force: bool = True):
        self.target = check_output(target, force)
        _make_parent(self.target)
        fd, name = tempfile.mkstemp(prefix=f".{self.target.name}.tmp-", dir=self.target.parent)
        os.close(fd)
        self.tmp = Path(name)
        self.tmp.chmod(0o666 & ~_umask())

    def commit(self) -> Path:
        os.replace(self.tmp, self.target)
        return self.target

    def discard(self) -> None:
        self.tmp.unlink(missing_ok=True)


@contextmanager
def _committed(out: AtomicDir | AtomicFile) -> Iterator[Path]:
    """Yield the temporary path; commit on success, discard on any exception."""
    try:
        yield out.tmp
    except BaseException:
        out.discard()
        raise
    out.commit()


def atomic_output_dir(target: Path, force: bool = False) -> AbstractContextManager[Path]:
    """A fresh temporary directory next to `target`; on success it becomes `target`."""
    return _committed(AtomicDir(target, force))


def atomic_output_file(target: Path, force: bool = True) -> AbstractContextManager[Path]:
    """A temporary file path next to `target`; on success it is renamed to `target`."""
    return _committed(AtomicFile(target, force))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _make_parent(target: Path) -> Path:
    """Create missing parent folders (as `mkdir -p`), with a one-line error when that is impossible."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"{target.parent}: cannot create the output folder ({e.strerror})") from None
    return target.parent
