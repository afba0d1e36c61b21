"""A calibrated run killed with -9 after a block resumes (`--resume`) and writes the same bytes as an
uninterrupted run: GPTQ and AWQ checkpoints, a GGUF through a method, the automatic mix; a run with other
options, or without `--resume`, starts over; the progress folder goes when the output is written."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmopt.formats.resume import _load_block, _save_block
from llmopt.quant.pipeline import BlockResult, LayerReport
from llmopt.quantized_tensor import QuantizedTensor

ROOT = Path(__file__).resolve().parents[2]
CALIB = ["--calib", "calib.txt", "--nsamples", "4", "--seqlen", "32"]
RUNS = {
    "gptq": ["quantize", "--method", "gptq", "--bits", "4", "--group-size", "32", *CALIB],
    "awq": ["quantize", "--method", "awq", "--bits", "4", "--group-size", "32", *CALIB],
    "gguf-gptq": ["convert", "--to", "gguf", "--type", "Q4_K_M", "--method", "gptq", *CALIB],
    "automix": ["convert", "--to", "gguf", "--target-bpw", "5", "--method", "gptq", "--sensitivity-samples", "2", *CALIB],
}


def _llmopt(cwd: Path, *args: str, fault: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "tests.faults", *fault, "--", *args] if fault else [sys.executable, "-m", "llmopt.cli.app", *args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env, timeout=600)


def _digest(path: Path) -> dict[str, str]:
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def _command(kind: str, model: Path, out: str) -> list[str]:
    command, *rest = RUNS[kind]
    return [command, str(model), *rest, "-o", out, "--json"]


@pytest.fixture
def work(tmp_path):
    (tmp_path / "calib.txt").write_text("The quick brown fox jumps over the lazy dog. A stitch in time saves nine. " * 40)
    return tmp_path


@pytest.mark.parametrize("kind", list(RUNS))
def test_killed_after_a_block_resumes_to_the_same_bytes(work, tiny_models, kind):
    model = tiny_models("llama")  # 2 blocks: killed after the first, half the run
    out = "out.gguf" if kind.startswith(("gguf", "automix")) else "out"
    (work / "whole").mkdir()
    (work / "whole" / "calib.txt").write_text((work / "calib.txt").read_text())
    assert _llmopt(work / "whole", *_command(kind, model, out)).returncode == 0  # the same command line elsewhere
    killed = _llmopt(work, *_command(kind, model, out), fault=("--kill-after-blocks", "1"))
    assert killed.returncode == -9
    progress = work / f".{out}.resume"
    assert (progress / "block-00000.safetensors").is_file() and not (work / out).exists()
    resumed = _llmopt(work, *_command(kind, model, out), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout)["resumed_blocks"] == 1
    assert _digest(work / out) == _digest(work / "whole" / out)
    assert not progress.exists() and not [p for p in work.iterdir() if ".tmp-" in p.name]


def test_without_resume_or_with_other_options_a_run_starts_over(work, tiny_models):
    model = tiny_models("llama")
    assert _llmopt(work, *_command("gptq", model, "out"), fault=("--kill-after-blocks", "1")).returncode == -9
    other = _llmopt(work, *_command("gptq", model, "out"), "--damp", "0.02", "--resume")  # another run's blocks
    assert other.returncode == 0 and json.loads(other.stdout)["resumed_blocks"] == 0
    assert _llmopt(work, *_command("gptq", model, "again"), fault=("--kill-after-blocks", "1")).returncode == -9
    fresh = _llmopt(work, *_command("gptq", model, "again"), "--force")  # no --resume: from the first block
    assert fresh.returncode == 0 and json.loads(fresh.stdout)["resumed_blocks"] == 0
    assert not (work / ".again.resume").exists()


def test_a_damaged_progress_folder_starts_over(work, tiny_models):
    """A block file truncated or deleted after the kill (a full disk, a cleanup) is no progress: the run
    starts over with one finished output, never a traceback."""
    model = tiny_models("llama")
    for damage in ("truncate", "delete"):
        out = f"out-{damage}"
        assert _llmopt(work, *_command("gptq", model, out), fault=("--kill-after-blocks", "1")).returncode == -9
        block = work / f".{out}.resume" / "block-00000.safetensors"
        if damage == "truncate":
            block.write_bytes(block.read_bytes()[:100])
        else:
            block.unlink()
        resumed = _llmopt(work, *_command("gptq", model, out), "--resume")
        assert resumed.returncode == 0, resumed.stderr
        assert json.loads(resumed.stdout)["resumed_blocks"] == 0 and (work / out).is_dir()


def test_a_block_result_survives_the_disk_field_for_field(tmp_path):
    """Every QuantizedTensor field (zeros, mins, g_idx, aux) and report comes back as it went, tensors that
    share memory (one g_idx for q, k and v under act-order; a view) included."""
    g = torch.Generator().manual_seed(0)
    a = QuantizedTensor(torch.randint(0, 16, (4, 64), dtype=torch.uint8, generator=g), torch.rand(4, 2, generator=g), 4, 32,
                        zeros=torch.randint(0, 16, (4, 2), generator=g).float(), g_idx=torch.arange(64) % 2, grid="int")  # fmt: skip
    b = QuantizedTensor(torch.randint(0, 16, (4, 256), dtype=torch.uint8, generator=g), torch.rand(4, 1, generator=g), 4, 256,
                        mins=torch.rand(4, 1, generator=g), grid="Q4_K", aux={"sub": torch.randint(0, 63, (4, 8), generator=g)})  # fmt: skip
    c = dataclasses.replace(a, scales=a.scales[:, :1], g_idx=a.g_idx)
    result = BlockResult(3, {"m.a": a, "m.b": b, "m.c": c}, [LayerReport("m.a", (4, 64), {"rel_err": 0.5}, {"gptq_loss": 1.5})], 2.5,
                         {"m.norm.weight": torch.rand(64, generator=g)})  # fmt: skip
    _save_block(result, tmp_path / "b.safetensors")
    back = _load_block(tmp_path / "b.safetensors")
    assert (back.layer, back.seconds, back.reports) == (3, 2.5, result.reports)
    for name, q in result.tensors.items():
        r = back.tensors[name]
        for field in q.__dataclass_fields__:
            x, y = getattr(q, field), getattr(r, field)
            if isinstance(x, torch.Tensor):
                assert torch.equal(x, y) and x.dtype == y.dtype
            elif isinstance(x, dict):
                assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
            else:
                assert x == y
    assert torch.equal(back.updated["m.norm.weight"], result.updated["m.norm.weight"])



def _key_of_every_grid(model: str) -> list[str]:
    """The resume key of a GPTQ run onto each GGUF grid and onto the integer grid (every module on it)."""
    from llmopt.formats.resume import run_key
    from llmopt.model import open_model
    from llmopt.options import QuantizeOptions
    from llmopt.quant.grids import GRIDS
    from llmopt.quant.spec import build_spec

    spec = build_spec(QuantizeOptions.of(), "gptq", True)
    tokens = torch.arange(64).reshape(2, 32)
    with open_model(model) as source:
        keys = [run_key(source, dataclasses.replace(spec, grids=lambda _m, g=g: g), tokens, torch.device("cpu"))
                for g in GRIDS.values()]  # fmt: skip
        return [*keys, run_key(source, spec, tokens, torch.device("cpu"))]


def test_the_resume_key_is_the_same_in_another_process_for_every_grid(tiny_models):
    """A key that held a memory address (Q6_K's, Q3_K's and the i-quants' grids hold tables) made every GGUF
    run with those types start over under `--resume`; the 7B-shape benchmark's automatic mix showed it."""
    model = str(tiny_models("llama"))
    code = f"import json; from tests.api.test_resume import _key_of_every_grid as k; print(json.dumps(k({model!r})))"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    there = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                      env=env, cwd=ROOT).stdout)  # fmt: skip
    here = _key_of_every_grid(model)
    assert here == there and len(set(here)) == len(here)
