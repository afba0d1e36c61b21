"""When the file system or the memory says no (no room, no such place, a name that is not UTF-8, a memory
limit met mid-run): exit 2, one line naming the output or the limit, and nothing left behind."""

from __future__ import annotations

import hashlib
import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.test_bad_input import assert_clean_failure


def _small_files() -> None:
    """A file-size limit of 64 KiB: writes beyond it fail as on a full disk (EFBIG, SIGXFSZ ignored)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))


def test_no_room_to_write(tiny_models, tmp_path):
    for to, out in (("hf", tmp_path / "out"), ("gguf", tmp_path / "out.gguf")):
        proc = subprocess.run([sys.executable, "-m", "llmopt.cli.app", "convert", str(tiny_models("llama")), "--to", to,
                               *(["--type", "F16"] if to == "gguf" else []), "-o", str(out)],
                              capture_output=True, text=True, preexec_fn=_small_files, env={**os.environ, "COLUMNS": "200"})  # fmt: skip
        assert_clean_failure(proc, f"{out}: ")  # "File too large", or numpy's "N requested and M written"
        assert list(tmp_path.iterdir()) == []  # neither the output nor a temporary file


def test_output_name_not_utf8(llmopt_here, tiny_models, tmp_path):
    out = os.fsdecode(os.fsencode(str(tmp_path)) + b"/\xff\xfe-model")
    assert_clean_failure(llmopt_here("convert", tiny_models("llama"), "--to", "hf", "-o", out), "the output name is not valid UTF-8")
    assert list(tmp_path.iterdir()) == []


def test_output_where_nothing_can_be_created(llmopt_here, tiny_models):
    assert_clean_failure(llmopt_here("convert", tiny_models("llama"), "--to", "gguf", "--type", "Q8_0", "-o", "/proc/model.gguf"),
                         "/proc/model.gguf: cannot write here")


def _faulty(*args, fault: list[str], cwd=None) -> subprocess.CompletedProcess:
    """llmopt ARGS with a fault set up first (tests/faults.py)."""
    return subprocess.run([sys.executable, "-m", "tests.faults", *fault, "--", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env={**os.environ, "COLUMNS": "200", "HF_HUB_OFFLINE": "1", "PYTHONPATH": ROOT}, timeout=600)  # fmt: skip


ROOT = str(Path(__file__).resolve().parents[2])
DISK_FILLS = ["--enospc-after", "20000", "--match", ".tmp-"]  # the disk fills 20 kB into the output


def test_disk_fills_during_convert_and_quantize(tiny_models, tmp_path):
    model = tiny_models("llama")
    for args, out in ((["convert", model, "--to", "gguf", "--type", "Q8_0"], tmp_path / "out.gguf"),
                      (["convert", model, "--to", "hf"], tmp_path / "out"),
                      (["quantize", model, "--method", "rtn", "--bits", "4", "--group-size", "32"], tmp_path / "gptq")):  # fmt: skip
        proc = _faulty(*args, "-o", out, fault=DISK_FILLS)
        assert_clean_failure(proc, f"error: {out}: No space left on device (nothing was written under this name")
        assert list(tmp_path.iterdir()) == []  # neither the output nor a temporary


def test_no_room_before_the_write_starts(tiny_models, tmp_path):
    out = tmp_path / "out.gguf"
    proc = _faulty("convert", tiny_models("llama"), "--to", "gguf", "--type", "F16", "-o", out, fault=["--free", "1000"])  # 1 kB free
    assert_clean_failure(proc, f"{out}: the output needs ")
    assert "has 0.0 MB free (free space or write elsewhere with -o)" in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_disk_fills_in_a_recipe_keeps_the_finished_output(tiny_models, tmp_path):
    (tmp_path / "release.yaml").write_text(f"""\
model: {tiny_models("llama")}
outputs:
  first: {{format: gguf, type: Q8_0}}
  second: {{format: gguf, type: F16}}
""")
    proc = _faulty("run", "release.yaml", "-o", "out", cwd=tmp_path, fault=["--enospc-after", "20000", "--match", "second"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "output second was not written" in errors[0] and "No space left on device" in errors[0]
    out = tmp_path / "out"
    manifest = json.loads((out / "manifest.json").read_text())
    assert list(manifest["outputs"]) == ["first"]
    (entry,) = manifest["outputs"].values()
    first = out / entry["path"]
    assert hashlib.sha256(first.read_bytes()).hexdigest() == entry["sha256"]
    assert not any("second" in p.name for p in out.rglob("*") if p.is_file() and "first" not in p.parts)


@pytest.mark.parametrize("room", [1_000_000, 5_000_000])
def test_a_memory_limit_met_mid_run_is_one_line(tiny_models, tmp_path, room):
    """RLIMIT_DATA a few MB above what the process holds after start-up: the check before work (which
    reads the system's and the cgroup's room) passes, and the run meets the limit mid-way."""
    (tmp_path / "calib.txt").write_text("The quick brown fox jumps over the lazy dog. " * 200)
    proc = _faulty("quantize", tiny_models("llama"), "--method", "gptq", "--bits", "4", "--group-size", "32", "--calib",
                   "calib.txt", "--nsamples", "64", "--seqlen", "64", "-o", "out", cwd=tmp_path, fault=["--data-room", str(room)])  # fmt: skip
    assert_clean_failure(proc, "error: out of memory (")
    assert "data limit" in proc.stderr and "lower what one call holds: --nsamples, --seqlen or --batch-size" in proc.stderr
    assert not (tmp_path / "out").exists() and not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
