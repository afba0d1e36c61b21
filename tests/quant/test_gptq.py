"""GPTQ against its defining properties: beats RTN on correlated inputs, equals RTN when H = I,
act-order groups, dead inputs, damping that rises until Cholesky succeeds."""

from __future__ import annotations

import logging

import pytest
import torch

from llmopt.calibration.hessian import HessianAccumulator
from llmopt.quant.gptq import GPTQConfig, gptq_quantize
from llmopt.quant.rtn import RTNConfig, rtn_quantize


def _problem(rows=96, cols=256, tokens=2048, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g)
    mix = torch.randn(cols, cols, generator=g) * 0.15 + torch.eye(cols)
    x = torch.randn(tokens, cols, generator=g) @ mix * torch.linspace(0.2, 3, cols)  # correlated, uneven energy
    acc = HessianAccumulator(cols)
    for chunk in x.split(500):
        acc.add(chunk)
    return w, x, acc.value()


def _out_err(x, w, q) -> float:
    return float(((x @ (w - q).t()) ** 2).mean())


def test_hessian_is_two_x_t_x_over_n() -> None:
    _, x, h = _problem(tokens=1000)
    assert torch.allclose(h, 2 * x.t() @ x / 1000, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("sym", [True, False])
def test_gptq_beats_rtn_on_outputs(bits: int, sym: bool) -> None:
    w, x, h = _problem()
    q = gptq_quantize(w, h, GPTQConfig(bits, 64, sym)).tensor.dequantize()
    r = rtn_quantize(w, RTNConfig(bits, 64, sym)).dequantize()
    assert _out_err(x, w, q) < (0.9 if bits == 2 else 0.8) * _out_err(x, w, r)


@pytest.mark.parametrize("group_size", [-1, 32, 128])
def test_identity_hessian_is_rtn(group_size: int) -> None:
    w, _, _ = _problem()
    result = gptq_quantize(w, torch.eye(256), GPTQConfig(4, group_size, False, damp=0.0))
    rtn = rtn_quantize(w, RTNConfig(4, group_size, False))
    assert torch.equal(result.tensor.codes, rtn.codes)
    assert torch.equal(result.tensor.dequantize(), rtn.dequantize())


def test_act_order_groups() -> None:
    w, x, h = _problem()
    plain = gptq_quantize(w, h, GPTQConfig(4, 32, True))
    ordered = gptq_quantize(w, h, GPTQConfig(4, 32, True, act_order=True))
    static = gptq_quantize(w, h, GPTQConfig(4, 32, True, act_order=True, static_groups=True))
    g_idx = ordered.tensor.g_idx
    perm = torch.argsort(torch.diag(h), descending=True)
    assert g_idx is not None and torch.equal(g_idx[perm].long(), torch.arange(256) // 32)  # groups in processing order
    assert torch.equal(torch.bincount(g_idx.long()), torch.full((8,), 32))
    assert static.tensor.g_idx is None  # static groups stay contiguous
    for r in (ordered, static):
        assert _out_err(x, w, r.tensor.dequantize()) < 1.1 * _out_err(x, w, plain.tensor.dequantize())


def test_dead_inputs_get_zero_weight() -> None:
    w, _, h = _problem()
    h[:, 5] = 0
    h[5, :] = 0
    q = gptq_quantize(w, h, GPTQConfig(4, 32, False)).tensor.dequantize()
    assert bool((q[:, 5] == 0).all())
    assert torch.isfinite(q).all()


def test_damping_rises_until_cholesky_succeeds(caplog) -> None:
    w, _, _ = _problem(cols=64)
    h = torch.eye(64)
    h[0, 1] = h[1, 0] = 1.2  # eigenvalue -0.2: needs damp > 0.2 of the mean diagonal
    with caplog.at_level(logging.WARNING):
        result = gptq_quantize(w[:, :64], h, GPTQConfig(4, 32, damp=0.01, damp_step=0.05), name="layers.3.mlp.down_proj")
    assert 0.2 < result.damp < 0.3
    assert "layers.3.mlp.down_proj" in caplog.text and "Cholesky failed" in caplog.text


def test_loss_is_sum_of_row_losses() -> None:
    w, _, h = _problem()
    r = gptq_quantize(w, h, GPTQConfig(3, 64))
    assert r.row_loss.shape == (96,) and r.loss == pytest.approx(float(r.row_loss.sum()))
    assert r.loss > 0


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("sym", [True, False])
def test_refit_scales_keeps_codes_and_lowers_the_objective(act_order: bool, sym: bool) -> None:
    """Re-solving the scales for GPTQ's final codes lowers (w - ŵ) H (w - ŵ)ᵀ; codes and zeros stay."""
    w, x, h = _problem()
    base = GPTQConfig(4, 64, sym, act_order=act_order, zero_min=1)
    plain = gptq_quantize(w, h, base).tensor
    refit = gptq_quantize(w, h, GPTQConfig(4, 64, sym, act_order=act_order, zero_min=1, refit_scales=True)).tensor
    assert torch.equal(plain.codes, refit.codes)
    assert plain.zeros is None and refit.zeros is None if sym else torch.equal(plain.zeros, refit.zeros)
    assert torch.equal(refit.scales, refit.scales.half().float())  # stored as float16
    assert _out_err(x, w, refit.dequantize()) < 0.99 * _out_err(x, w, plain.dequantize())


def test_fp_target_matches_the_full_precision_output() -> None:
    """GPTAQ: when the layer's inputs are distorted (x) but the model should give W·x_fp, quantizing
    toward W* = W + W·C·H⁻¹ reproduces W·x_fp better than GPTQ on W with the same H."""
    w, x_fp, _ = _problem()
    g = torch.Generator().manual_seed(5)
    x = x_fp + 0.3 * torch.randn(x_fp.shape, generator=g) * x_fp.std(0)  # what upstream quantization feeds it
    acc = HessianAccumulator(x.shape[1], cross=True)
    for a, b in zip(x.split(500), x_fp.split(500)):
        acc.add(a, b)
    target = x_fp @ w.t()

    def err(cfg):
        q = gptq_quantize(w, acc.value(), cfg, cross=acc.cross).tensor.dequantize()
        return float(((x @ q.t() - target) ** 2).mean())

    plain, aq = err(GPTQConfig(4, 64, False)), err(GPTQConfig(4, 64, False, fp_target=1.0))
    assert aq < 0.9 * plain


def test_group_aware_order_keeps_groups_contiguous_and_helps() -> None:
    """act-order inside contiguous groups: no g_idx, groups of the original columns, lower output
    error than plain GPTQ on inputs of uneven energy (the case act-order exists for)."""
    w, x, h = _problem(cols=320)  # 320 = 2 full groups of 128 and a partial one of 64
    plain = gptq_quantize(w, h, GPTQConfig(4, 128, True)).tensor
    aware = gptq_quantize(w, h, GPTQConfig(4, 128, True, group_aware=True)).tensor
    assert aware.g_idx is None and aware.scales.shape == plain.scales.shape == (96, 3)
    assert _out_err(x, w, aware.dequantize()) < _out_err(x, w, plain.dequantize())
