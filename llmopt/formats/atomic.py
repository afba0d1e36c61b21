"""Outputs appear whole or not at all: write under a temporary name beside the target, then rename.

`check_output` is the one "may I write here?" rule (refused when the target exists, unless
`force`; an empty folder counts as free); `check_free_space` refuses, before any work, an output
whose planned size the target's file system has no room for. A disk that fills anyway during the
write (another writer) raises ENOSPC; the temporary is removed on the way out (the CLI's one
line, exit 2), so a full disk never leaves a file under the final name. `AtomicDir` / `AtomicFile` hold the temporary name for a
writer that works in steps (a sink fed block by block); `atomic_output_dir` / `atomic_output_file`
wrap them for code that writes in one go.

Temporary names carry the writer's process id (`.NAME.tmp-PID-XXXX`), so the next writer of the
same target removes what a killed one left (`remove_orphans`: only when that process is gone).
Before the rename the data and the folder are fsynced, so after a crash of the machine the final
name holds the whole output or the old one, never a file whose blocks never reached the disk.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

from llmopt.errors import InputError, OptionError


def check_output(target: Path, force: bool, directory: bool = False) -> Path:
    """The resolved target, or an error if writing it would replace something without `force`."""
    target = Path(target).expanduser().resolve()
    try:
        str(target).encode("utf-8")
    except UnicodeEncodeError:
        shown = os.fsencode(target).decode("utf-8", "backslashreplace")
        raise InputError(f"{shown}: the output name is not valid UTF-8 (model files name each other in UTF-8)") from None
    if target.exists():
        if directory and not target.is_dir():
            raise InputError(f"{target}: exists and is not a directory")
        if not directory and target.is_dir():
            raise InputError(f"{target}: is a directory")
        free = directory and not any(target.iterdir())
        if not force and not free:
            raise OptionError(f"{target}: already exists (use <force> to replace it)")
    return target


def check_free_space(target: Path, planned_bytes: int | None) -> None:
    """A one-line InputError when the file system holding `target` has less free space than the
    output's planned size (unknown sizes, and file systems that will not say, pass)."""
    if not planned_bytes:
        return
    try:
        usage = shutil.disk_usage(target.parent)
    except OSError:
        return
    if usage.total and planned_bytes > usage.free:  # (pseudo file systems report a total of 0)
        raise InputError(f"{target}: the output needs {_size(planned_bytes)} and {target.parent} has "
                         f"{_size(usage.free)} free (free space or write elsewhere with -o)")  # fmt: skip


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


_UNFINISHED: set[Path] = set()  # targets whose temporaries this process made and has not committed or discarded


def discard_unfinished() -> list[Path]:
    """Remove every temporary this process made for a target it has not committed or discarded: what
    the CLI does on its way out after Ctrl-C or SIGTERM, whichever line the signal landed on (even
    between a temporary's creation and the `with` that would have removed it). The temporaries are
    found by name (`.NAME.tmp-PID-*` beside the target), which is registered before one is made."""
    removed = []
    for target in list(_UNFINISHED):
        for p in target.parent.glob(f"{_prefix(target, 'tmp')}*"):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() and not p.is_symlink() else p.unlink(missing_ok=True)
            removed.append(p)
    _UNFINISHED.clear()
    return removed


class AtomicDir:
    """A fresh temporary folder next to `target` (`.tmp`); `commit()` makes it `target`, `discard()` removes it."""

    def __init__(self, target: Path, force: bool = False, planned_bytes: int | None = None):
        self.target = check_output(target, force, directory=True)
        parent = _make_parent(self.target)
        check_free_space(self.target, planned_bytes)
        remove_orphans(parent, self.target.name)
        _UNFINISHED.add(self.target)
        try:
            self.tmp = Path(tempfile.mkdtemp(prefix=_prefix(self.target, "tmp"), dir=parent))
        except OSError as e:
            raise InputError(f"{self.target}: cannot write here ({e.strerror})") from None
        self.tmp.chmod(0o777 & ~_umask())  # mkdtemp makes it private; the result should look like mkdir's

    def commit(self) -> Path:
        parent = self.target.parent
        for path in sorted(self.tmp.rglob("*"), reverse=True):  # files before the folders holding them
            _fsync(path)
        _fsync(self.tmp)
        if self.target.exists():
            trash = Path(tempfile.mkdtemp(prefix=_prefix(self.target, "old"), dir=parent))
            os.replace(self.target, trash / self.target.name)
            os.replace(self.tmp, self.target)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(self.tmp, self.target)
        _UNFINISHED.discard(self.target)
        _fsync(parent)
        return self.target

    def discard(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
        _UNFINISHED.discard(self.target)


class AtomicFile:
    """A temporary file next to `target` (`.tmp`); `commit()` renames it to `target`, `discard()` removes it."""

    def __init__(self, target: Path, force: bool = True, planned_bytes: int | None = None):
        self.target = check_output(target, force)
        remove_orphans(_make_parent(self.target), self.target.name)
        check_free_space(self.target, planned_bytes)
        _UNFINISHED.add(self.target)
        try:
            fd, name = tempfile.mkstemp(prefix=_prefix(self.target, "tmp"), dir=self.target.parent)
        except OSError as e:
            raise InputError(f"{self.target}: cannot write here ({e.strerror})") from None
        os.close(fd)
        self.tmp = Path(name)
        self.tmp.chmod(0o666 & ~_umask())

    def commit(self) -> Path:
        _fsync(self.tmp)
        os.replace(self.tmp, self.target)
        _UNFINISHED.discard(self.target)
        _fsync(self.target.parent)
        return self.target

    def discard(self) -> None:
        self.tmp.unlink(missing_ok=True)
        _UNFINISHED.discard(self.target)


@contextmanager
def _committed(out: AtomicDir | AtomicFile) -> Iterator[Path]:
    """Yield the temporary path; commit on success, discard on any exception."""
    try:
        yield out.tmp
    except BaseException:
        out.discard()
        raise
    out.commit()


def atomic_output_dir(target: Path, force: bool = False, planned_bytes: int | None = None) -> AbstractContextManager[Path]:
    """A fresh temporary directory next to `target`; on success it becomes `target`."""
    return _committed(AtomicDir(target, force, planned_bytes))


def atomic_output_file(target: Path, force: bool = True) -> AbstractContextManager[Path]:
    """A temporary file path next to `target`; on success it is renamed to `target`."""
    return _committed(AtomicFile(target, force))


_TEMP = re.compile(r"^\.(?P<name>.+)\.(?:tmp|old)-(?P<pid>\d+)-[^.]*$")


def remove_orphans(folder: Path, name: str | None = None) -> list[Path]:
    """Remove the temporary files and folders that writers of `name` (any name: None) left in
    `folder` when they were killed: those whose process is gone. Returns what was removed."""
    removed = []
    try:
        entries = list(folder.iterdir())
    except OSError:
        return removed
    for p in entries:
        m = _TEMP.match(p.name)
        if m is None or (name is not None and m.group("name") != name) or _alive(int(m.group("pid"))):
            continue
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() and not p.is_symlink() else p.unlink(missing_ok=True)
        removed.append(p)
    return removed


def target_of(path: str) -> str:
    """The output a temporary path stands for (`DIR/.NAME.tmp-PID-X/part` -> `DIR/NAME`), for messages
    that should name what the user asked for; other paths unchanged."""
    parts = Path(path).parts
    for i, part in enumerate(parts):
        m = _TEMP.match(part)
        if m is not None:
            return str(Path(*parts[:i], m.group("name")))
    return path


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # someone else's live process (or not a pid we can ask about): leave it
    return True


def _prefix(target: Path, kind: str) -> str:
    return f".{target.name}.{kind}-{os.getpid()}-"


def _fsync(path: Path) -> None:
    """Flush a file's (or a folder's entries') data to the disk; best effort where the OS refuses."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


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
