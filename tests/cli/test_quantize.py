"""`llmopt quantize`: end to end on a tiny model, and bad input as one-line errors with nothing left behind."""

from __future__ import annotations

import json

import pytest

from tests.cli.test_bad_input import assert_clean_failure


@pytest.fixture
def calib_txt(tmp_path):
    from tests.factories import CORPUS

    path = tmp_path / "calib.txt"
    path.write_text(CORPUS)
    return path


def test_gptq_act_order_with_report(llmopt_cli, tiny_models, tmp_path, calib_txt) -> None:
    out, report = tmp_path / "q", tmp_path / "layers.json"
    r = llmopt_cli("quantize", tiny_models("llama"), "--method", "gptq", "--bits", "3", "--group-size", "32", "--act-order",
                   "--calib", calib_txt, "--nsamples", "4", "--seqlen", "32", "--report", report, "-o", out)
    assert r.returncode == 0, r.stderr
    assert "SQNR" in r.stdout and "wrote" in r.stdout
    rep = json.loads(report.read_text())
    assert len(rep["layers"]) == 14 and {"mse", "max_abs", "cosine", "sqnr_db", "gptq_loss"} <= set(rep["layers"][0])
    assert [b["layer"] for b in rep["blocks"]] == [0, 1]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["desc_act"] is True and cfg["quantization_config"]["bits"] == 3
    assert cfg["llmopt"]["calibration"]["nsamples"] == 4 and len(cfg["llmopt"]["calibration"]["sha256"]) == 64
    r = llmopt_cli("--json", "inspect", out)
    assert r.returncode == 0 and "model.layers.0.self_attn.q_proj.weight" not in r.stdout  # summary only
    info = json.loads(r.stdout)
    assert info["parameters"] > 0


def test_rtn_dense_json(llmopt_here, tiny_models, tmp_path) -> None:
    out = tmp_path / "d"
    r = llmopt_here("--json", "quantize", tiny_models("qwen2"), "--method", "rtn", "--bits", "5", "--group-size", "-1",
                   "--asym", "--format", "dense", "-o", out)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["format"] == "dense" and len(res["layers"]) == 14
    assert all(layer["sqnr_db"] > 20 for layer in res["layers"])
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["llmopt"]["method"] == "rtn"


def test_tight_symmetric_scale_is_written_and_recorded(llmopt_here, tiny_models, tmp_path) -> None:
    """--sym-scale tight: the checkpoint is GPTQ's symmetric layout (zero 8) with the tight grid's codes
    and scales, read back by llmopt's reader as the grid made them, and recorded in the provenance."""
    import torch

    from llmopt.model import open_model
    from llmopt.quant.grids import IntGrid

    out = tmp_path / "t"
    r = llmopt_here("--json", "quantize", tiny_models("llama"), "--method", "rtn", "--group-size", "32",
                    "--sym-scale", "tight", "-o", out)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["sym_scale"] == "tight"
    assert json.loads((out / "config.json").read_text())["llmopt"]["sym_scale"] == "tight"
    src, written = open_model(tiny_models("llama")), open_model(out)
    name = "model.layers.0.mlp.down_proj.weight"
    want = IntGrid(4, True, 32, sym_scale="tight").quantize(src.load(name)).dequantize(torch.float32)
    assert torch.equal(written.load(name), want)
    assert not torch.equal(want, IntGrid(4, True, 32).quantize(src.load(name)).dequantize(torch.float32))


def test_calib_self_default(llmopt_here, tiny_models, tmp_path) -> None:
    out = tmp_path / "s"
    r = llmopt_here("--json", "quantize", tiny_models("llama"), "--group-size", "32", "--nsamples", "2", "--seqlen", "16", "-o", out)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["calibration"]["source"] == "self"


def test_gptaq_and_refit_scales_are_recorded(llmopt_here, tiny_models, tmp_path) -> None:
    out = tmp_path / "aq"
    r = llmopt_here("quantize", tiny_models("llama"), "--group-size", "32", "--nsamples", "2", "--seqlen", "16",
                         "--asym", "--act-order", "--mse", "--refit-scales", "--gptaq", "0.25", "--calib-dtype", "float32",
                         "-o", out)
    assert r.returncode == 0, r.stderr
    gptq = json.loads((out / "config.json").read_text())["llmopt"]["gptq"]
    assert gptq == {"damp": 0.01, "act_order": True, "group_aware_order": False, "static_groups": False, "mse": True,
                    "refit_scales": True, "gptaq": 0.25, "calib_dtype": "float32"}


@pytest.mark.parametrize("args, expect", [
    (["--bits", "5"], "GPTQ checkpoints hold 2, 3, 4, 8 bits"),
    (["--bits", "9", "--format", "dense"], "choose 2 to 8"),
    (["--group-size", "128"], "larger than the 64 input features"),
    (["--method", "gptq", "--group-size", "0"], "per tensor"),
    (["--calib", "NOWHERE/x.txt"], "no such file"),
    (["--calib", "EMPTY"], "holds no text"),
    (["--calib-field", "text"], "--calib-field applies to .jsonl and .parquet files"),  # with the default --calib self
    (["--seqlen", "1"], "need at least 1 sample of 2 tokens"),
    (["--damp", "1.5"], "--damp"),
    (["--method", "rtn", "--act-order"], "apply to --method gptq"),
    (["--method", "rtn", "--refit-scales"], "apply to --method gptq"),
    (["--group-aware-order", "--act-order"], "choose one"),
    (["--gptaq", "1.5"], "--gptaq 1.5: choose a strength in [0, 1]"),
    (["--damp-step", "0"], "--damp-step 0.0: expected a value in (0, 1)"),
    (["--device", "tpu"], "bad --device"),
    (["--calib-dtype", "int8"], "'int8' is not one of 'auto', 'float32', 'bfloat16', 'float16'"),
    (["--method", "rtn", "--calib-dtype", "bfloat16"], "--calib-dtype applies to calibrated methods"),
    (["--method", "awq", "--act-order"], "--act-order, --group-aware-order, --static-groups, --refit-scales and "
                                         "--gptaq apply to --method gptq and awq+gptq"),
    (["--method", "awq", "--bits", "5", "--format", "awq"], "--bits 5: AWQ checkpoints hold 4 bits"),
    (["--method", "awq", "--bits", "3"], "--bits 3: AWQ checkpoints hold 4 bits"),  # the awq format by default
    (["--method", "awq+gptq", "--act-order"], "--act-order needs --static-groups in AWQ checkpoints"),
    (["--method", "gptq", "--no-clip"], "--no-clip (AWQ's clipping search) applies to --method awq"),
    (["--method", "awq", "--format", "gguf"], "--format"),
    (["--asym", "--sym-scale", "tight"], "--sym-scale chooses the symmetric grid's scale: it needs --sym"),
    (["--sym-scale", "max"], "'max' is not one of 'gptq', 'tight'"),
])
def test_bad_input(llmopt_here, tiny_models, tmp_path, args, expect) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    args = [str(empty) if a == "EMPTY" else str(tmp_path / a) if a.startswith("NOWHERE") else a for a in args]
    if "--group-size" not in args:
        args += ["--group-size", "32"]
    out = tmp_path / "out"
    r = llmopt_here("quantize", tiny_models("llama"), *args, "-o", out)
    assert_clean_failure(r, expect)
    assert list(tmp_path.glob("*out*")) == []


def test_existing_output_is_refused_before_work(llmopt_here, tiny_models, tmp_path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("x")
    r = llmopt_here("quantize", tiny_models("llama"), "--method", "rtn", "--group-size", "32", "-o", out)
    assert_clean_failure(r, "already exists")
    assert (out / "keep").read_text() == "x"


@pytest.mark.parametrize("kwargs, expect", [
    ({}, True),  # GPTQModel's default: act-order inside contiguous groups
    ({"act_order": True}, False),
    ({"static_groups": True}, False),
    ({"group_size": -1}, False),
    ({"group_aware": False}, False),
])
def test_group_aware_order_is_the_default_with_groups(kwargs, expect) -> None:
    from llmopt.options import QuantizeOptions
    from llmopt.quant.gptq import GPTQConfig
    from llmopt.quant.spec import build_spec

    spec = build_spec(QuantizeOptions.of(**kwargs), "gptq", True)
    assert isinstance(spec.method, GPTQConfig) and spec.method.group_aware is expect


def test_awq_refuses_a_stage_without_a_foldable_producer(llmopt_here, tiny_models, tmp_path, monkeypatch) -> None:
    """A family whose stage table names a producer AWQ cannot fold into: one line naming the module."""
    import dataclasses

    import llmopt.model.families as families
    from llmopt.model.families.base import LLAMA_STAGES, Stage

    odd = dataclasses.replace(families.LLAMA, stages=(Stage(LLAMA_STAGES[0].linears, "self_attn", "self_attn"),
                                                      *LLAMA_STAGES[1:]))
    monkeypatch.setattr(families, "FAMILIES", (odd, *families.FAMILIES[1:]))
    calib = tmp_path / "c.txt"
    calib.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    r = llmopt_here("quantize", tiny_models("llama"), "--method", "awq", "--group-size", "32", "--calib", calib,
                    "--nsamples", "2", "--seqlen", "16", "-o", tmp_path / "out")
    assert_clean_failure(r, "model.layers.0.self_attn: AWQ cannot fold its scales into this module")
    assert not list(tmp_path.glob("*out*"))
