"""Atomic outputs: temporary names a later writer recognizes, and kill -9 at any moment of a
conversion leaves nothing under the final name until it is whole, and nothing behind after a rerun."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmopt.formats.atomic import AtomicDir, AtomicFile, atomic_output_file, discard_unfinished, remove_orphans


def dead_pid() -> int:
    """The pid of a process that has ended."""
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout)


def test_orphans_of_dead_writers_go_and_live_ones_stay(tmp_path):
    dead, live = dead_pid(), os.getppid()
    (tmp_path / f".m.gguf.tmp-{dead}-x1").write_bytes(b"half")
    (tmp_path / f".m.gguf.old-{dead}-x2").mkdir()
    (tmp_path / f".m.gguf.tmp-{live}-x3").write_bytes(b"someone is writing this")
    (tmp_path / f".other.gguf.tmp-{dead}-x4").write_bytes(b"another target's")
    (tmp_path / ".hidden-but-mine").write_bytes(b"not a temporary name")
    with atomic_output_file(tmp_path / "m.gguf") as tmp:
        assert tmp.name.startswith(f".m.gguf.tmp-{os.getpid()}-")
        tmp.write_bytes(b"whole")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f".m.gguf.tmp-{live}-x3", f".other.gguf.tmp-{dead}-x4", ".hidden-but-mine", "m.gguf"])
    assert [p.name for p in remove_orphans(tmp_path)] == [f".other.gguf.tmp-{dead}-x4"]


def _tree_sha(path: Path) -> str:
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return hashlib.sha256(b"".join(hashlib.sha256(p.read_bytes()).digest() for p in files)).hexdigest()


def test_unfinished_temporaries_go_on_the_way_out_and_finished_ones_stay(tmp_path):
    """A signal may land between a temporary's creation and the `with` that would remove it (the CLI
    then calls discard_unfinished): every temporary not committed or discarded goes, and only those."""
    left_dir, left_file = AtomicDir(tmp_path / "d"), AtomicFile(tmp_path / "f.gguf")  # never entered
    done = AtomicFile(tmp_path / "done.gguf")
    done.tmp.write_bytes(b"x")
    done.commit()
    dropped = AtomicDir(tmp_path / "e")
    dropped.discard()
    other = tmp_path / f".d.tmp-{os.getpid() + 1}-keep"  # another process's: not ours to remove
    other.mkdir()
    assert left_dir.tmp.is_dir() and left_file.tmp.is_file()
    assert sorted(discard_unfinished()) == sorted([left_dir.tmp, left_file.tmp])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["done.gguf", other.name])
    assert discard_unfinished() == []


@pytest.mark.slow
@pytest.mark.parametrize("to", ["gguf", "hf"])
def test_kill_9_at_ten_moments_then_rerun(smollm2_hf, smollm2_gguf, tmp_path, to):
    """SIGKILL at ten moments spread over a conversion of SmolLM2: the final name never holds a
    partial output, and the same command run again finishes with the same bytes and no leftovers."""
    source, args = (smollm2_hf, ["--type", "Q4_K_M"]) if to == "gguf" else (smollm2_gguf, ["--dtype", "float16"])
    target = tmp_path / ("out.gguf" if to == "gguf" else "out")
    command = [sys.executable, "-m", "llmopt.cli.app", "convert", str(source), "--to", to, *args, "-o", str(target), "--force"]
    start = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True)  # the same command (a GGUF records it) uninterrupted
    took = time.perf_counter() - start
    expected = _tree_sha(target)
    shutil.rmtree(target) if target.is_dir() else target.unlink()
    for i in range(10):
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(took * (i + 0.5) / 10)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if target.exists():  # a kill after the rename: then it is whole
            assert _tree_sha(target) == expected, f"kill {i}: a partial output under the final name"
    subprocess.run(command, check=True, capture_output=True)
    assert _tree_sha(target) == expected
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary file left
