"""Outputs appear whole or not at all: write under a temporary name beside the target, then rename."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from llmopt.errors import InputError


@contextmanager
def atomic_output_dir(target: Path, force: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary directory next to `target`; on success it becomes `target`."""
    target = target.expanduser().resolve()
    if target.exists() and not (target.is_dir() and not any(target.iterdir())) and not force:
        raise InputError(f"{target}: already exists (use --force to replace it)")
    if target.exists() and not target.is_dir():
        raise InputError(f"{target}: exists and is not a directory")
    parent = _make_parent(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=parent))
    tmp.chmod(0o777 & ~_umask())  # mkdtemp makes it private; the result should look like mkdir's
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if target.exists():
        trash = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=parent))
        os.replace(target, trash / target.name)
        os.replace(tmp, target)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, target)


@contextmanager
def atomic_output_file(target: Path, force: bool = True) -> Iterator[Path]:
    """Yield a temporary file path next to `target`; on success it is renamed to `target`."""
    target = target.expanduser().resolve()
    _make_parent(target)
    if target.is_dir():
        raise InputError(f"{target}: is a directory")
    if target.exists() and not force:
        raise InputError(f"{target}: already exists (use --force to replace it)")
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.tmp-", dir=target.parent)
    os.close(fd)
    tmp = Path(name)
    tmp.chmod(0o666 & ~_umask())
    try:
        yield tmp
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, target)


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
