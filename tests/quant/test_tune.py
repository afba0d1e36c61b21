"""Learned rounding (quant/tune.py): it starts exactly at the method's answer, never leaves a block
worse on the calibration tokens than that answer, lowers it on a real block, and is deterministic
under a seed; its checkpoint reads back with the tuned codes. FP4's grids (a set of 15 levels) are
tuned along their levels the same way."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from llmopt.model import open_model
from llmopt.quant.gptq import GPTQConfig
from llmopt.quant.grids import IntGrid
from llmopt.quant.grids.fp4 import MXFP4, NVFP4Grid
from llmopt.quant.grids.fp8 import FP8
from llmopt.quant.grids.nvfp4 import NVFP4, nvfp4_grid
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


@pytest.mark.parametrize("grid", [MXFP4, NVFP4Grid(), NVFP4, FP8], ids=lambda g: g.name)
def test_a_levelled_start_is_the_methods_answer_and_moves_along_the_levels(grid) -> None:
    """FP4 and FP8 (codes on a set of levels): with no offset the result is the method's codes (some a level off nearest, as GPTQ's are), bit for
    bit; offsets move codes only to levels of the grid, by one level per half-step of offset; gradients flow."""
    torch.manual_seed(0)
    w = torch.randn(24, 256)
    qt = grid.quantize(w)
    levels = torch.tensor(grid.code_levels)
    rank = torch.searchsorted(levels, qt.codes.long())
    qt.codes = levels[(rank + torch.randint(-1, 2, rank.shape)).clamp(0, len(levels) - 1)].to(qt.codes.dtype)
    lin = _Linear.of(w, qt, grid.code_levels)
    assert torch.equal(lin.result().codes, qt.codes)
    assert torch.equal(lin.result().dequantize(torch.float32), qt.dequantize(torch.float32))
    (lin.dequantized() - w).pow(2).sum().backward()
    assert lin.v.grad.abs().sum() > 0
    with torch.no_grad():
        lin.v.fill_(0.5)
    moved = torch.searchsorted(levels, lin.result().codes.long()) - torch.searchsorted(levels, qt.codes.long())
    assert torch.isin(lin.result().codes.long(), levels).all() and set(moved.unique().tolist()) <= {0, 1}
    assert (moved == 1).float().mean() > 0.3


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
    assert all(d["tune_mse"] <= d["tune_start_mse"] for d in details)
    # the first block sees the same inputs with and without tuning: there the gain is the tuning's own
    first = [d for d in details[:7]]
    assert all(d["tune_kept"] == 1 and d["tune_mse"] < 0.8 * d["tune_start_mse"] for d in first), first
    assert any(not torch.equal(tuned[n].codes, start[n].codes) for n in tuned)


def test_targets_are_the_float_models_block_outputs_and_inputs_the_quantized_models(tmp_path, monkeypatch) -> None:
    """Each block is fitted to the float model's outputs (transformers' hidden states), from the inputs the
    quantized blocks before it give: it also makes up for their error (AutoRound's default)."""
    import transformers

    from llmopt.quant import pipeline

    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    real = pipeline.tune_block

    def spy(block, weights, start, forward, targets, config, layer, levels=None):
        floats = {f"{name}.weight": w for name, w in weights.items()}
        seen.append((forward(block, floats, slice(None)).detach().clone(), targets.clone()))
        return real(block, weights, start, forward, targets, config, layer, levels)

    monkeypatch.setattr(pipeline, "tune_block", spy)
    source_dir = make_tiny_hf(tmp_path / "src", "llama", layers=3)
    with open_model(source_dir) as src:
        tokens = _tokens(src, n=4, t=24)
        _run(src, QuantizeSpec(RTNConfig(2, 16, False), batch_size=2, tune=TuneConfig(2, None, 2)), tokens)
    model = transformers.AutoModelForCausalLM.from_pretrained(source_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        hidden = model(tokens, output_hidden_states=True).hidden_states  # [k]: block k's input; the last is normed
    assert len(seen) == 3
    for layer in (0, 1):
        torch.testing.assert_close(seen[layer][1], hidden[layer + 1], rtol=1e-4, atol=1e-4)
    # the float block on block 0's inputs gives its targets; from block 1 on the inputs are the quantized model's
    assert torch.allclose(seen[0][0], seen[0][1], atol=1e-5)
    assert not torch.allclose(seen[1][0], seen[1][1], atol=1e-2)


def test_the_compiled_rounding_is_the_eager_one_and_a_failed_compile_falls_back(tmp_path, monkeypatch, caplog) -> None:
    from llmopt.quant import tune

    w = torch.randn(48, 96, generator=torch.Generator().manual_seed(0))
    lin = _Linear.of(w, IntGrid(bits=3, sym=False, group_size=32).quantize(w))
    with torch.no_grad():
        lin.v.uniform_(-0.5, 0.5)
        lin.gain.uniform_(-0.1, 0.1)
    results = []
    for rounding in (tune.fake_quantized, tune.compiled_fake_quantized()):
        out = lin.dequantized(rounding)
        out.pow(2).sum().backward()
        results.append((out.detach(), lin.v.grad.clone(), lin.gain.grad.clone()))
        lin.v.grad = lin.gain.grad = None
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)

    # a compile that fails (no compiler on the machine): the block is tuned uncompiled, with the same codes
    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(tune, "COMPILE_MIN_WORK", 0)
    monkeypatch.setattr(tune, "compiled_fake_quantized", lambda: broken)
    monkeypatch.setattr(tune, "_compile_failed", [])
    method = GPTQConfig(2, 16, True)
    with open_model(make_tiny_hf(tmp_path / "src", "llama")) as src:
        tokens = _tokens(src, n=8, t=32)
        spec = QuantizeSpec(method, batch_size=4, tune=TuneConfig(10, None, 4))
        fallen, _ = _run(src, spec, tokens)
        assert tune._compile_failed == ["no C++ compiler"] and "runs uncompiled" in caplog.text
        monkeypatch.setattr(tune, "COMPILE_MIN_WORK", float("inf"))
        eager, _ = _run(src, spec, tokens)
    assert all(torch.equal(fallen[n].codes, eager[n].codes) for n in eager)


def test_step_sizes_default_to_autorounds_rule_capped_and_a_fifth_for_the_scales_after_gptq() -> None:
    from llmopt.options import QuantizeOptions
    from llmopt.quant.spec import build_spec

    assert (TuneConfig(200).rate, TuneConfig(20).rate, TuneConfig(20, 0.05).rate) == (0.005, 0.01, 0.05)
    assert (TuneConfig(200).scale_rate, TuneConfig(20, 0.05).scale_rate, TuneConfig(20, scale_lr=0.0).scale_rate) == (
        0.001, 0.01, 0.0)
    # from round-to-nearest's min-max scales, the scales step as the offsets do (AutoRound's minmax_lr)
    tuned = {m: build_spec(QuantizeOptions(iters=200), m, False).tune for m in ("rtn", "gptq", "awq", "awq+gptq")}
    assert tuned["rtn"].scale_rate == tuned["rtn"].rate == 0.005
    assert all(tuned[m].scale_rate == 0.001 for m in ("gptq", "awq", "awq+gptq"))
    assert build_spec(QuantizeOptions(iters=200, scale_lr=0.002), "rtn", False).tune.scale_rate == 0.002


def test_a_zero_scale_step_keeps_the_methods_scales_and_still_tunes_the_codes(tmp_path) -> None:
    method = GPTQConfig(2, 16, True)
    with open_model(make_tiny_hf(tmp_path / "src", "llama")) as src:
        tokens = _tokens(src, n=8, t=32)
        start, _ = _run(src, QuantizeSpec(method, batch_size=4), tokens)
        fixed, details = _run(src, QuantizeSpec(method, batch_size=4, tune=TuneConfig(40, None, 4, scale_lr=0.0)), tokens)
        moved, _ = _run(src, QuantizeSpec(method, batch_size=4, tune=TuneConfig(40, None, 4)), tokens)
    # the first block sees the same inputs in every run (GPTQ's scales in later ones follow their inputs)
    first = [n for n, d in zip(fixed, details) if n.startswith("model.layers.0.") and d["tune_kept"] == 1]
    assert first and all(torch.equal(fixed[n].scales, start[n].scales) for n in first)
    assert any(not torch.equal(fixed[n].codes, start[n].codes) for n in first)
    assert any(not torch.equal(moved[n].scales, start[n].scales) for n in first)  # the default step moves them


def test_fp4_tuning_lowers_each_blocks_error_and_repeats_under_a_seed(tmp_path) -> None:
    """`--scheme nvfp4a16 --iters`: codes tuned along FP4's levels under the grid's own scales (group and
    global scales unchanged), every block at least as close to the float block as round-to-nearest."""
    method = RTNConfig(4, 16, True)
    with open_model(make_tiny_hf(tmp_path / "src", "llama")) as src:
        tokens = _tokens(src, n=8, t=32)
        start, _ = _run(src, QuantizeSpec(method, grids=nvfp4_grid, batch_size=4), tokens)
        spec = QuantizeSpec(method, grids=nvfp4_grid, batch_size=4, tune=TuneConfig(40, None, 4, seed=0))
        tuned, details = _run(src, spec, tokens)
        again, _ = _run(src, spec, tokens)
    assert all(torch.equal(tuned[n].codes, again[n].codes) for n in tuned)
    assert all(torch.equal(tuned[n].scales, start[n].scales) for n in tuned)
    assert all(torch.equal(tuned[n].aux["group_scale"], start[n].aux["group_scale"]) for n in tuned)
    assert all(d["tune_mse"] <= d["tune_start_mse"] for d in details)
    assert any(d["tune_kept"] == 1 and d["tune_mse"] < 0.9 * d["tune_start_mse"] for d in details), details
    assert any(not torch.equal(tuned[n].codes, start[n].codes) for n in tuned)
    levels = torch.tensor(NVFP4.code_levels)
    assert all(torch.isin(qt.codes.long(), levels).all() for qt in tuned.values())


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
    # (from round-to-nearest the scales step as the offsets do)
    assert json.loads((out / "config.json").read_text())["llmopt"]["tune"] == {"iters": 4, "lr": 0.01, "scale_lr": 0.01,
                                                                                "batch_size": 8, "seed": 3}
    assert all("tune_mse" in layer for layer in json.loads(r.stdout)["layers"])
    for args, expect in ((["--lr", "0.01"], "--lr is learned rounding's step size: it needs --iters > 0"),
                         (["--scale-lr", "0"], "--scale-lr is learned rounding's step size: it needs --iters > 0"),
                         (["--iters", "-1"], "--iters")):
        r = llmopt_here("quantize", tiny_models("llama"), "--group-size", "32", *args, "-o", tmp_path / "bad")
        assert_clean_failure(r, expect)
        assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("mix,tuned_type,iters", [("Q2_K", "_K", "30")])
def test_gguf_types_are_tuned_and_llama_cpp_reads_the_file(llmopt_here, tmp_path, mix, tuned_type, iters) -> None:
    """`convert --method gptq --iters`: the K-type linears of a Q2_K mix are tuned (codes only: their scales are sub-scale codes or fp16 from the search), the
    gguf package reads the tuned tensors, and llama.cpp loads the file and generates."""
    import gguf
    from gguf.quants import dequantize
    from llama_cpp import Llama

    from tests.factories import CORPUS
    from tests.formats.gguf.models import make_wide_hf

    src = make_wide_hf(tmp_path / "hf", "llama", layers=2)
    calib = tmp_path / "c.txt"
    calib.write_text(CORPUS)
    base = ["--json", "convert", src, "--to", "gguf", "--type", mix, "--method", "gptq", "--calib", calib,
            "--nsamples", "4", "--seqlen", "64", "--batch-size", "2"]
    plain, tuned = tmp_path / "gptq.gguf", tmp_path / "tuned.gguf"
    assert llmopt_here(*base, "-o", plain).returncode == 0
    done = llmopt_here(*base, "--iters", iters, "-o", tuned)
    assert done.returncode == 0, done.stderr
    layers = json.loads(done.stdout)["layers"]
    assert all(r["tune_mse"] <= r["tune_start_mse"] for r in layers)
    assert any(r["tune_mse"] < 0.97 * r["tune_start_mse"] for r in layers)
    a = {t.name: t for t in gguf.GGUFReader(str(plain)).tensors}
    b = {t.name: t for t in gguf.GGUFReader(str(tuned)).tensors}
    changed = [n for n in a if n.startswith("blk.") and a[n].tensor_type.name.endswith(tuned_type)
               and not np.array_equal(a[n].data, b[n].data)]
    assert changed and all(a[n].tensor_type == b[n].tensor_type for n in a)
    with open_model(tuned) as ours:  # the gguf package reads the tuned tensors as llmopt does (q/k aside: permuted)
        family = ours.arch.family
        for name in (n for n in changed if "attn_q" not in n and "attn_k" not in n):
            theirs = torch.from_numpy(dequantize(b[name].data, b[name].tensor_type).copy())
            mine = ours.load(family.gguf_to_hf_name(name), torch.float32)
            assert torch.equal(theirs.reshape(mine.shape), mine), name
    llm = Llama(model_path=str(tuned), n_ctx=64, verbose=False, n_threads=2)
    assert isinstance(llm("The quick brown fox", max_tokens=8, temperature=0)["choices"][0]["text"], str)
