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
    (["--type", "Q4_K_M"], "--output"),
    (["--type", "Q4_K_M", "--imatrix", "/nonexistent/im.gguf", "--dry-run"], "no such file"),
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
