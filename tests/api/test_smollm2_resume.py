"""On the real SmolLM2 (30 blocks): GPTQ and AWQ checkpoints and an automatic-mix GGUF, each killed with
kill -9 from outside once half its blocks are recorded (wherever in the next block the signal lands),
resume with `--resume` to the bytes of an uninterrupted run of the same command.

A block counts as recorded when the next block's inputs say so (`inputs.safetensors`, written after
the block's own file), so the test waits for that record and, after the kill, reads how far it got:
under load the kill can land between a block's file and its record, or a block or two later."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors import safe_open

from tests.api.test_resume import _digest

pytestmark = pytest.mark.slow

DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "wikitext-2" / "valid.txt"
CALIB = ["--calib", str(DATA), "--nsamples", "4", "--seqlen", "64"]
RUNS = {
    "gptq": (["quantize", "--method", "gptq", "--bits", "4", *CALIB], "out"),
    "awq": (["quantize", "--method", "awq", "--bits", "4", *CALIB], "out"),
    "automix": (["convert", "--to", "gguf", "--target-bpw", "5", "--method", "gptq", "--sensitivity-samples", "4", *CALIB],
                "out.gguf"),
}


def _start(model: Path, kind: str, cwd: Path, *extra: str) -> subprocess.Popen:
    command, *rest = RUNS[kind][0]
    return subprocess.Popen([sys.executable, "-m", "llmopt.cli.app", command, str(model), *rest, "-o", RUNS[kind][1],
                             "--json", *extra], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})  # fmt: skip


def _recorded(progress: Path) -> int:
    """How many blocks a progress folder holds as finished (0 before its first record)."""
    try:
        with safe_open(str(progress / "inputs.safetensors"), "pt") as f:
            return int((f.metadata() or {}).get("next", 0))
    except Exception:  # not written yet (each write is a rename, so never torn)
        return 0


def _finish(proc: subprocess.Popen) -> dict:
    stdout, stderr = proc.communicate(timeout=1800)
    assert proc.returncode == 0, stderr[-2000:]
    return json.loads(stdout)


@pytest.mark.parametrize("kind", list(RUNS))
def test_killed_halfway_resumes_to_the_same_bytes(smollm2_gguf, tmp_path, kind):
    out = RUNS[kind][1]
    (tmp_path / "whole").mkdir()
    (tmp_path / "killed").mkdir()
    _finish(_start(smollm2_gguf, kind, tmp_path / "whole"))  # alone: two runs at once oversubscribe the cores
    run = _start(smollm2_gguf, kind, tmp_path / "killed")
    progress = tmp_path / "killed" / f".{out}.resume"
    deadline = time.monotonic() + 1800
    while _recorded(progress) < 15:  # half of 30 blocks
        assert run.poll() is None, run.communicate()[1][-2000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    run.send_signal(signal.SIGKILL)
    run.communicate(timeout=60)
    assert run.returncode == -9 and not (tmp_path / "killed" / out).exists()
    recorded = _recorded(progress)  # what the kill left: 15, or more if blocks finished before it landed
    assert 15 <= recorded < 30
    summary = _finish(_start(smollm2_gguf, kind, tmp_path / "killed", "--resume"))
    assert summary["resumed_blocks"] == recorded
    assert _digest(tmp_path / "killed" / out) == _digest(tmp_path / "whole" / out)
