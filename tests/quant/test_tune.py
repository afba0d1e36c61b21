"""Learned rounding (quant/tune.py): it starts exactly at the method's answer, never leaves a block
worse on the calibration tokens than that answer, lowers it on a real block, and is deterministic
under a seed; its checkpoint reads back with the tuned codes."""

from __future__ import annotations

import json

import pytest
import torch

from llmopt.model import open_model
from llmopt.quant.gptq import GPTQConfig
from llmopt.quant.grids import IntGrid
from llmopt.quant.pipeline import QuantizeSpec, quantize_model
from llmopt.quant.rtn import RTNConfig
from llmopt.quant.tune import TuneConfig, _Linear
from tests.cli.test_bad_input import assert_clean_failure
from tests.factories import make_tiny_hf, write_checkpoint
from tests.quant.test_pipeline import _tokens


@pytest.mark.parametrize("sym,group_size,g_idx", [(True, 32, False), (False, 32, False), (False, -1, False),
                                                  (True, 0, False), (False, 32, True)])
def test_the_start_is_the_methods_answer(sym, group_size, g_idx) -> None:
    """With no offset and no gain, the tuned result is the method's codes and scales, bit for bit
    (codes off round-to-nearest, as GPTQ's are, and act-order's column groups included)."""
    torch.manual_seed(0)
    w = torch.randn(24, 96)
    qt = IntGrid(3, sym, group_size).quantize(w)
    qt.codes = torch.clamp(qt.codes.to(torch.int16) + torch.randint(-1, 2, qt.codes.shape), 0, 7).to(torch.uint8)
    if g_idx:
        qt.g_idx = torch.randperm(96) // 32
    out = _Linear.of(w, qt).result()
    assert torch.equal(out.codes, qt.codes) and torch.equal(out.scales, qt.scales.float())
    assert torch.equal(out.dequantize(torch.float32), qt.dequantize(torch.float32))


def _run(src, spec, tokens):
    blocks = list(quantize_model(src, spec, tokens))
    return {n: qt for b in blocks for n, qt in b.tensors.items()}, [r.details for b in blocks for r in b.reports]


@pytest.mark.parametrize("method", [RTNConfig(2, 16, False), GPTQConfig(2, 16, True)])
def test_tuning_lowers_each_blocks_error_and_repeats_under_a_seed(tmp_path, method) -> None:
    with open_model(make_tiny_hf(tmp_path / "src", "llama")) as src:
        tokens = _tokens(src, n=8, t=32)
        start, _ = _run(src, QuantizeSpec(method, batch_size=4), tokens)
        spec = QuantizeSpec(method, batch_size=4, tune=TuneConfig(40, None, 4, seed=0))
        tuned, details = _run(src, spec, tokens)
        again, _ = _run(src, spec, tokens)
        other, _ = _run(src, QuantizeSpec(method, batch_size=4, tune=TuneConfig(40, None, 4, seed=1)), tokens)
    assert all(torch.equal(tuned[n].codes, again[n].codes) and torch.equal(tuned[n].scales, again[n].scales) for n in tuned)
    assert any(not torch.equal(tuned[n].codes, other[n].codes) for n in tuned)  # the seed picks the steps' samples
    assert all(d["tune_loss"] <= d["tune_loss_start"] for d in details)
    # the first block sees the same inputs with and without tuning: there the gain is the tuning's own
    first = [d for d in details[:7]]
    assert all(d["tune_kept"] == 1 and d["tune_loss"] < 0.8 * d["tune_loss_start"] for d in first), first
    assert any(not torch.equal(tuned[n].codes, start[n].codes) for n in tuned)


def test_a_tuned_checkpoint_reads_back_with_its_codes(tmp_path) -> None:
    spec = QuantizeSpec(GPTQConfig(4, 32, True), batch_size=4, tune=TuneConfig(10, None, 4, seed=0))
    with open_model(make_tiny_hf(tmp_path / "src", "llama")) as src:
        tokens = _tokens(src, n=4, t=32)
        blocks = list(quantize_model(src, spec, tokens))
        out = write_checkpoint(src, spec, iter(blocks), tmp_path / "q")
    tensors = {n: qt for b in blocks for n, qt in b.tensors.items()}
    with open_model(out) as q:
        for name, qt in tensors.items():
            assert torch.equal(q.load(f"{name}.weight", torch.float32), qt.dequantize(torch.float32)), name


def test_cli_records_the_tuning_and_refuses_what_it_cannot_tune(llmopt_here, tiny_models, tmp_path) -> None:
    out = tmp_path / "t"
    r = llmopt_here("--json", "quantize", tiny_models("llama"), "--method", "rtn", "--bits", "3", "--group-size", "32",
                    "--iters", "4", "--nsamples", "2", "--seqlen", "16", "--seed", "3", "-o", out)
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "config.json").read_text())["llmopt"]["tune"] == {"iters": 4, "lr": 0.25, "batch_size": 8, "seed": 3}
    assert all("tune_loss" in layer for layer in json.loads(r.stdout)["layers"])
    for args, expect in ((["--lr", "0.01"], "--lr is learned rounding's step size: it needs --iters > 0"),
                         (["--iters", "5", "--scheme", "fp8-dynamic"], "--iters (learned rounding) tunes the integer grid"),
                         (["--iters", "-1"], "--iters")):
        r = llmopt_here("quantize", tiny_models("llama"), "--group-size", "32", *args, "-o", tmp_path / "bad")
        assert_clean_failure(r, expect)
        assert not (tmp_path / "bad").exists()
