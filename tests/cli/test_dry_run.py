"""`--dry-run` prints each streamed pass's memory and time and writes nothing; a block that cannot fit
is refused before any work: one line, exit 2, no output."""

from __future__ import annotations

import json

import torch

import pytest

from tests.cli.test_bad_input import assert_clean_failure
from tests.cli.test_quantize import calib_txt  # noqa: F401 - the fixture


def test_quantize_dry_run_writes_nothing(llmopt_here, tiny_models, tmp_path, calib_txt) -> None:
    out = tmp_path / "q"
    r = llmopt_here("quantize", tiny_models("llama"), "--group-size", "32", "--calib", calib_txt, "--nsamples", "4",
                    "--seqlen", "32", "--dry-run", "-o", out)
    assert r.returncode == 0, r.stderr
    assert "gptq: 2 blocks, 4 x 32 calibration tokens" in r.stdout and "one block needs" in r.stdout
    assert not out.exists()
    r = llmopt_here("--json", "quantize", tiny_models("llama"), "--group-size", "32", "--target-bpw", "4", "--dry-run")
    plan = json.loads(r.stdout)
    assert [p["pass"] for p in plan["passes"]] == ["sensitivity", "gptq"] and plan["passes"][1]["fits"]
    assert plan["passes"][1]["calibration_tokens"] == 128 * 512
    gptq = plan["passes"][1]  # the time model's measured fraction: this machine's time and a GPU's lower bound
    assert gptq["seconds"] > 0 and 0 < gptq["gpu_seconds"] < gptq["seconds"] and gptq["gpu"] == "h100-80g"


def test_convert_and_imatrix_dry_runs_show_the_passes(llmopt_here, tiny_models, tmp_path, calib_txt) -> None:
    r = llmopt_here("--json", "convert", tiny_models("llama"), "--to", "gguf", "--type", "Q8_0", "--method", "gptq",
                    "--nsamples", "4", "--seqlen", "32", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert [p["pass"] for p in json.loads(r.stdout)["passes"]] == ["gptq"]
    r = llmopt_here("--json", "convert", tiny_models("llama"), "--to", "gguf", "--type", "Q8_0", "--dry-run")
    assert "passes" not in json.loads(r.stdout)  # llama.cpp's own searches stream tensor by tensor
    r = llmopt_here("imatrix", tiny_models("llama"), "--calib", calib_txt, "-c", "32", "--dry-run")
    assert r.returncode == 0 and "imatrix: 2 blocks" in r.stdout


@pytest.mark.parametrize("command", ["quantize", "convert", "imatrix"])
def test_a_block_that_cannot_fit_is_refused_before_any_work(llmopt_here, tiny_models, tmp_path, calib_txt,
                                                            monkeypatch, command) -> None:  # fmt: skip
    from llmopt import memory

    monkeypatch.setattr(memory, "available_memory", lambda: 100_000)
    monkeypatch.setattr(memory, "cgroup_memory_room", lambda: None)
    out = tmp_path / "out"
    args = {"quantize": ("quantize", "--group-size", "32", "--nsamples", "4", "--seqlen", "32"),
            "convert": ("convert", "--to", "gguf", "--type", "Q8_0", "--method", "gptq", "--nsamples", "4", "--seqlen", "32"),
            "imatrix": ("imatrix", "-c", "32")}[command]  # fmt: skip
    r = llmopt_here(args[0], tiny_models("llama"), *args[1:], "--calib", calib_txt, "-o", out)
    lever = "--chunks/--ctx-size" if command == "imatrix" else "--nsamples/--seqlen"
    assert_clean_failure(r, f"0.1 MiB is available: lower {lever} or free memory")
    assert "one block of this model needs" in r.stderr
    assert list(tmp_path.glob("out*")) == []


def test_self_written_calibration_needs_the_whole_model(llmopt_here, tmp_path, monkeypatch) -> None:
    """`--calib self` generates with the whole model: where one block fits but the model does not, the
    refusal says so and names the way out (a calibration file)."""
    from llmopt import memory
    from llmopt.api.budget import pipeline_workload
    from llmopt.api.quantize import prepare
    from llmopt.model import open_model
    from llmopt.options import QuantizeOptions
    from llmopt.plan.footprint import SELF_WRITTEN, footprint
    from tests.factories import make_tiny_hf

    deep = make_tiny_hf(tmp_path / "deep", layers=24)  # many small blocks: the model outweighs one block's work
    flags = dict(group_size=32, nsamples=4, seqlen=32, calib_dtype="float32")
    job = prepare(QuantizeOptions.of(**flags), torch.device("cpu"))
    with open_model(deep) as source:
        fp = footprint(source.arch, pipeline_workload(job.spec, job.calibration))
    others = max(fp.block_bytes, *(v for k, v in fp.steps.items() if k != SELF_WRITTEN))
    assert fp.steps[SELF_WRITTEN] > others
    monkeypatch.setattr(memory, "available_memory", lambda: (fp.steps[SELF_WRITTEN] + others) // 2)
    monkeypatch.setattr(memory, "cgroup_memory_room", lambda: None)
    out = tmp_path / "out"
    r = llmopt_here("quantize", deep, *(f"--{k.replace('_', '-')}={v}" for k, v in flags.items()), "-o", out)
    assert_clean_failure(r, "give --calib a text file or free memory")
    assert "(--calib self) holds all of it" in r.stderr
    assert list(tmp_path.glob("out*")) == []
