"""Content fingerprints: sha256 of files and folders, and of settings written as canonical JSON.

A rerun must not rehash gigabytes to learn that nothing changed, so file hashes are remembered in
a small JSON cache keyed by (path, size, mtime): a file that was rewritten has another mtime.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from llmopt.formats.atomic import atomic_output_file

_CHUNK = 1 << 22


def canonical_sha256(value: Any) -> str:
    """sha256 of `value` as sorted, compact JSON: the same settings give the same hash."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def tree_files(path: Path, exclude: tuple[str, ...] = ()) -> list[Path]:
    """A file, or a folder's regular files (recursively, sorted; hidden names and `exclude` left out)."""
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
                  and p.relative_to(path).as_posix() not in exclude)  # fmt: skip


class HashCache:
    """sha256 of files, remembered by (size, mtime_ns) in a JSON file (None: not remembered)."""

    def __init__(self, file: Path | None = None):
        self.file = file
        self.known: dict[str, list[Any]] = {}
        if file is not None and file.is_file():
            try:
                self.known = json.loads(file.read_text())
            except (OSError, ValueError):
                self.known = {}

    def sha256(self, path: Path) -> str:
        st = path.stat()
        key = str(path.resolve())
        hit = self.known.get(key)
        if hit is not None and hit[0] == st.st_size and hit[1] == st.st_mtime_ns:
            return hit[2]
        digest = hashlib.sha256()
        with path.open("rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
        self.known[key] = [st.st_size, st.st_mtime_ns, digest.hexdigest()]
        return digest.hexdigest()

    def tree(self, path: Path, exclude: tuple[str, ...] = ()) -> tuple[str, int, list[dict[str, Any]]]:
        """(sha256, bytes, files) of a file, or of a folder: the sha256 of its `sha256sum` listing
        ("<hash>  <relative path>" per line, sorted by path)."""
        files = [{"path": p.name if p == path else p.relative_to(path).as_posix(), "sha256": self.sha256(p),
                  "bytes": p.stat().st_size} for p in tree_files(path, exclude)]  # fmt: skip
        if path.is_file():
            return files[0]["sha256"], files[0]["bytes"], files
        listing = "".join(f"{f['sha256']}  {f['path']}\n" for f in files)
        return hashlib.sha256(listing.encode("utf-8")).hexdigest(), sum(f["bytes"] for f in files), files

    def save(self) -> None:
        if self.file is None:
            return
        with atomic_output_file(self.file) as tmp:
            tmp.write_text(json.dumps(self.known, indent=0, sort_keys=True))
