"""`llmopt convert --to gguf` and `llmopt imatrix` from the command line."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest



@pytest.fixture(scope="module")
def wide_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.formats.gguf.models import make_wide_hf

    return make_wide_hf(tmp_path_factory.mktemp("cli-wide") / "hf", "llama", layers=2)


def test_dry_run_size_is_the_written_size(llmopt_here, wide_hf: Path, tmp_path: Path) -> None:  # noqa: F811
    args = ["convert", wide_hf, "--to", "gguf", "--type", "Q4_K_M", "--tensor-type", "attn_v=Q8_0"]
    plan = llmopt_here(*args, "--dry-run", "--json")
    assert plan.returncode == 0, plan.stderr
    summary = json.loads(plan.stdout)
    out = tmp_path / "m.gguf"
    done = llmopt_here(*args, "-o", out, "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert out.stat().st_size == summary["file_bytes"] == result["bytes"]
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(out)).tensors}
    assert types == {t["tensor"]: t["type"] for t in summary["tensors"]}
    assert types["blk.0.attn_v.weight"] == "Q8_0" and types["blk.0.attn_q.weight"] == "Q4_K"


def test_dry_run_table(llmopt_here, wide_hf: Path) -> None:  # noqa: F811
    res = llmopt_here("convert", wide_hf, "--to", "gguf", "--type", "Q3_K_M", "--dry-run")
    assert res.returncode == 0, res.stderr
    assert "blk.0.attn_v.weight" in res.stdout and "Q5_K" in res.stdout and "file size" in res.stdout


@pytest.mark.parametrize(("args", "message"), [
    (["--type", "Q4_K_XL", "--dry-run"], "unknown GGUF type"),
    (["--type", "Q4_K_M", "--tensor-type", "attn_v", "--dry-run"], "REGEX=TYPE"),
    (["--type", "Q4_K_M", "--tensor-type", "attn_v=Q9_9", "--dry-run"], "unknown GGML type"),
    (["--type", "Q4_K_M", "--tensor-type", "attn_v=Q8_K", "--dry-run"], "llmopt does not write Q8_K"),
    (["--type", "Q4_K_M", "--output-tensor-type", "Q8_1", "--dry-run"], "llmopt does not write Q8_1"),
    (["--type", "Q4_K_M"], "--output"),
    (["--type", "Q4_K_M", "--imatrix", "/nonexistent/im.gguf", "--dry-run"], "no such file"),
    (["--type", "Q4_K_M", "--method", "rtn", "-o", "/tmp/never.gguf"], "is not one of 'gptq', 'awq', 'awq+gptq'"),
    (["--type", "F16", "--method", "gptq", "-o", "/tmp/never.gguf"], "rounds onto quantized types; F16 has none"),
    (["--type", "Q4_K_M", "--method", "gptq", "--act-order", "-o", "/tmp/never.gguf", "--nsamples", "2",
      "--seqlen", "16"], "--act-order onto Q4_K needs --static-groups"),
    (["--type", "Q2_K_S", "-o", "/tmp/never.gguf"], "Q2_K_S's Q2_K needs an importance matrix for blk.0."),
    (["--type", "IQ3_XXS", "-o", "/tmp/never.gguf"], "needs an importance matrix for blk.0."),
])
def test_bad_input_is_one_line_exit_2(llmopt_here, wide_hf: Path, args: list[str], message: str) -> None:  # noqa: F811
    res = llmopt_here("convert", wide_hf, "--to", "gguf", *args)
    assert res.returncode == 2 and message in res.stderr, res.stderr


def test_existing_output_needs_force(llmopt_here, wide_hf: Path, tmp_path: Path) -> None:  # noqa: F811
    out = tmp_path / "m.gguf"
    out.write_bytes(b"keep me")
    res = llmopt_here("convert", wide_hf, "--to", "gguf", "--type", "Q8_0", "-o", out)
    assert res.returncode == 2 and out.read_bytes() == b"keep me"
    assert llmopt_here("convert", wide_hf, "--to", "gguf", "--type", "Q8_0", "-o", out, "--force").returncode == 0
    assert out.read_bytes()[:4] == b"GGUF"


def test_imatrix_then_convert_with_it(llmopt_here, wide_hf: Path, tmp_path: Path) -> None:  # noqa: F811
    from tests.factories import CORPUS

    text = tmp_path / "calib.txt"
    text.write_text(CORPUS * 3)
    im = tmp_path / "im.gguf"
    res = llmopt_here("imatrix", wide_hf, "--calib", text, "-o", im, "--ctx-size", "64", "--chunks", "4", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["entries"] == 2 * 7
    out = tmp_path / "q.gguf"
    res = llmopt_here("convert", wide_hf, "--to", "gguf", "--type", "Q4_0", "--imatrix", im, "-o", out)
    assert res.returncode == 0, res.stderr
    fields = gguf.GGUFReader(str(out)).fields
    assert fields["quantize.imatrix.chunks_count"].contents() == 4
    assert fields["quantize.imatrix.entries_count"].contents() == 14
    plain = tmp_path / "plain.gguf"
    assert llmopt_here("convert", wide_hf, "--to", "gguf", "--type", "Q4_0", "-o", plain).returncode == 0
    weighted = {t.name: bytes(t.data) for t in gguf.GGUFReader(str(out)).tensors}
    unweighted = {t.name: bytes(t.data) for t in gguf.GGUFReader(str(plain)).tensors}
    assert weighted["blk.0.ffn_down.weight"] != unweighted["blk.0.ffn_down.weight"]  # the imatrix was used
    assert weighted["output.weight"] == unweighted["output.weight"]  # no entry for it: plain quantization


@pytest.mark.parametrize("method", ["gptq", "awq", "awq+gptq"])
def test_calibrated_methods_write_the_mix_that_llama_cpp_runs(llmopt_here, wide_hf: Path, tmp_path: Path,
                                                             method: str) -> None:  # noqa: F811
    """`--method` rounds the block linears itself: the file has the plan's types and size, the codes
    read back through gguf's dequantize as the pipeline made them (AWQ's folded norms too), and
    llama.cpp loads it and generates."""
    from llama_cpp import Llama

    from llmopt.model import open_model
    from tests.factories import CORPUS

    calib = tmp_path / "c.txt"
    calib.write_text(CORPUS)
    base = ["convert", wide_hf, "--to", "gguf", "--type", "Q4_K_M"]
    plan = json.loads(llmopt_here(*base, "--dry-run", "--json").stdout)
    out = tmp_path / f"{method}.gguf"
    done = llmopt_here(*base, "-o", out, "--method", method, "--calib", calib, "--nsamples", "4", "--seqlen", "64", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["method"] == method and len(result["layers"]) == 14
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(out)).tensors}
    assert types == {t["tensor"]: t["type"] for t in plan["tensors"]}
    assert abs(out.stat().st_size - plan["file_bytes"]) < 4096  # the same tensors; the header records the method
    with open_model(out) as q, open_model(wide_hf) as src:
        norm = "model.layers.0.input_layernorm.weight"
        moved = (q.load(norm) - src.load(norm).half().float()).abs().max()
        first = next(r for r in result["layers"] if r["name"].startswith("model.layers.0."))
        folded = method.startswith("awq") and not first.get("fallback_kept", 0)  # awq+gptq may keep GPTQ alone
        assert (moved > 1e-3) == folded  # AWQ folded its scales into the norm
        # AWQ moves a per-channel scale between a linear and its producer, so compare what the fold
        # leaves unchanged: q_proj's columns times the norm, down_proj's columns times up_proj's rows
        def invariant(m, name):
            w = m.load(f"model.layers.1.{name}.weight")
            if name.endswith("q_proj"):
                return w * m.load("model.layers.1.input_layernorm.weight")
            return w * m.load("model.layers.1.mlp.up_proj.weight").norm(dim=1)

        for name in ("self_attn.q_proj", "mlp.down_proj"):
            ours, theirs = invariant(q, name), invariant(src, name)
            assert (ours - theirs).abs().max() < 0.5 * theirs.abs().max(), name
    llm = Llama(model_path=str(out), n_ctx=64, verbose=False, n_threads=2)
    text = llm("The quick brown fox", max_tokens=8, temperature=0)["choices"][0]["text"]
    assert isinstance(text, str) and llm.n_tokens > 4


def test_method_applies_to_gguf_only(llmopt_here, wide_hf: Path, tmp_path: Path) -> None:  # noqa: F811
    res = llmopt_here("convert", wide_hf, "--to", "hf", "-o", tmp_path / "hf", "--method", "gptq")
    assert res.returncode == 2 and "--method applies to --to gguf" in res.stderr, res.stderr
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("tuning", [["--iters", "5"], ["--scale-lr", "0.01"]])
def test_learned_rounding_needs_a_method(llmopt_here, wide_hf: Path, tmp_path: Path, tuning) -> None:  # noqa: F811
    res = llmopt_here("convert", wide_hf, "--to", "gguf", "--type", "Q4_K_M", "-o", tmp_path / "q.gguf", *tuning)
    expect = "--iters, --lr and --scale-lr (learned rounding) tune what a calibrated --method"
    assert res.returncode == 2 and expect in res.stderr, res.stderr
    assert not (tmp_path / "q.gguf").exists()
