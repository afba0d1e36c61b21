"""`llmopt convert --to gguf --target-size/--target-bpw`: the automatic mix on a tiny random model."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest

from llmopt.formats.gguf.types import aligned, candidate_types, tensor_nbytes
from llmopt.plan.sensitivity import cache_path


@pytest.fixture(scope="module")
def wide_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.formats.gguf.models import make_wide_hf

    return make_wide_hf(tmp_path_factory.mktemp("automix") / "hf", "llama", layers=2)


@pytest.fixture(scope="module")
def calib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.factories import CORPUS

    path = tmp_path_factory.mktemp("automix-calib") / "c.txt"
    path.write_text(CORPUS)
    return path


def _args(wide_hf: Path, calib: Path, *more: object) -> list:
    return ["convert", wide_hf, "--to", "gguf", "--calib", calib, "--sensitivity-samples", "2", "--seqlen", "64", *more]


def _plain_size(llmopt_here, wide_hf: Path, mix: str) -> int:
    done = llmopt_here("convert", wide_hf, "--to", "gguf", "--type", mix, "--dry-run", "--json")
    return json.loads(done.stdout)["file_bytes"]


def _smallest_upgrade(summary: dict) -> int:
    """The least number of bytes any chosen tensor would add by moving to a larger candidate type."""
    steps = []
    for t in summary["tensors"]:
        if t["type"] == "F32":
            continue
        now = aligned(t["bytes"], 32)
        larger = [aligned(tensor_nbytes(c, t["shape"]), 32) - now for c in candidate_types(t["shape"])]
        steps += [s for s in larger if s > 0]
    return min(steps)


def test_target_size_is_met_to_one_step_and_the_file_is_what_was_planned(llmopt_here, wide_hf: Path, calib: Path,
                                                                          tmp_path: Path) -> None:  # fmt: skip
    """The plan fits the target, within one tensor's smallest step; the cost table is cached beside
    the output and reused; the file is the plan, loads in llama.cpp and generates."""
    from llama_cpp import Llama

    target = (_plain_size(llmopt_here, wide_hf, "Q4_K_M") + _plain_size(llmopt_here, wide_hf, "Q5_K_M")) // 2
    out = tmp_path / "auto.gguf"
    dry = llmopt_here(*_args(wide_hf, calib, "--target-size", str(target), "-o", out, "--dry-run", "--json"))
    assert dry.returncode == 0, dry.stderr
    plan = json.loads(dry.stdout)
    assert not out.exists() and cache_path(out).is_file()
    assert plan["file_bytes"] <= target
    assert target - plan["file_bytes"] < _smallest_upgrade(plan)
    assert plan["automix"]["target_bytes"] == target and not plan["automix"]["cached"]
    assert plan["automix"]["predicted_kld"] > 0
    assert len(set(plan["types"]) - {"F32"}) >= 2  # a mix, not one type

    done = llmopt_here(*_args(wide_hf, calib, "--target-size", str(target), "-o", out, "--json"))
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["automix"]["cached"] and result["automix"]["predicted_kld"] == plan["automix"]["predicted_kld"]
    assert out.stat().st_size == plan["file_bytes"] == result["bytes"]
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(out)).tensors}
    assert types == {t["tensor"]: t["type"] for t in plan["tensors"]}
    llm = Llama(model_path=str(out), n_ctx=64, verbose=False, n_threads=2)
    text = llm("The quick brown fox", max_tokens=8, temperature=0)["choices"][0]["text"]
    assert isinstance(text, str) and llm.n_tokens > 4


def test_same_seed_same_bytes_and_bpw_target(llmopt_here, wide_hf: Path, calib: Path, tmp_path: Path) -> None:
    """Two runs measured from scratch (separate caches) write the same bytes; --target-bpw is met."""
    outs = [tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf"]
    for out in outs:
        done = llmopt_here(*_args(wide_hf, calib, "--target-bpw", "5.0", "--method", "gptq", "--nsamples", "4",
                                  "-o", out, "--json"))  # fmt: skip
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout)
        assert not result["automix"]["cached"] and result["method"] == "gptq"
    assert outs[0].read_bytes() == outs[1].read_bytes()
    plan = json.loads(llmopt_here(*_args(wide_hf, calib, "--target-bpw", "5.0", "-o", outs[0], "--dry-run",
                                         "--json")).stdout)  # fmt: skip
    assert plan["bits_per_weight"] <= 5.0


def test_a_target_below_the_smallest_file_names_it(llmopt_here, wide_hf: Path, calib: Path, tmp_path: Path) -> None:
    out = tmp_path / "never.gguf"
    res = llmopt_here(*_args(wide_hf, calib, "--target-size", "1000", "-o", out))
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "the smallest file this model makes is" in res.stderr and "--target-size 1000" in res.stderr
    assert not out.exists() and not cache_path(out).exists()


@pytest.mark.parametrize(("args", "message"), [
    (["--target-size", "10MB", "--target-bpw", "4"], "--target-size and --target-bpw are two ways"),
    (["--target-bpw", "0"], "--target-bpw 0.0: expected bits per weight"),
    (["--target-size", "lots"], "bad --target-size 'lots'"),
])  # fmt: skip
def test_bad_targets_are_one_line_exit_2(llmopt_here, wide_hf: Path, calib: Path, args: list[str], message: str) -> None:
    res = llmopt_here(*_args(wide_hf, calib, *args, "--dry-run"))
    assert res.returncode == 2 and message in res.stderr, res.stderr


def test_targets_apply_to_gguf_only(llmopt_here, wide_hf: Path, tmp_path: Path) -> None:
    res = llmopt_here("convert", wide_hf, "--to", "hf", "-o", tmp_path / "hf", "--target-bpw", "4")
    assert res.returncode == 2 and "--target-size and --target-bpw apply to --to gguf" in res.stderr, res.stderr
