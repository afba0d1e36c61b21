"""Rooflines: decode = bandwidth / bytes per step; prefill = FLOPs / peak."""

import pytest

from llmopt.plan.presets import get_preset
from llmopt.plan.roofline import (Device, decode_bytes_per_step, decode_tokens_per_s, experts_touched_fraction,
                                  prefill_flops, prefill_seconds)


def test_decode_bound_is_bandwidth_over_bytes_read():
    arch = get_preset("llama-3-8b").arch
    step = decode_bytes_per_step(arch, weight_bytes=5_000_000_000, expert_bytes=0, kv_bytes_per_seq=0)
    assert decode_tokens_per_s(step, Device(1000)) == pytest.approx(200.0)
    with_kv = decode_bytes_per_step(arch, 5_000_000_000, 0, kv_bytes_per_seq=1_000_000_000, batch=4)
    assert with_kv == 9_000_000_000  # weights once for the batch, each sequence's cache


def test_moe_reads_only_routed_experts():
    arch = get_preset("mixtral-8x7b").arch
    assert experts_touched_fraction(arch, 1) == pytest.approx(2 / 8)
    assert experts_touched_fraction(arch, 64) == pytest.approx(1.0, abs=1e-6)
    step = decode_bytes_per_step(arch, weight_bytes=100, expert_bytes=80, kv_bytes_per_seq=0)
    assert step == 20 + 20
    assert experts_touched_fraction(get_preset("llama-3-8b").arch, 1) == 1.0


def test_prefill_is_two_flops_per_parameter_plus_causal_attention():
    arch = get_preset("llama-3-8b").arch
    flops = prefill_flops(arch, active_params=8_000_000_000, tokens=1000)
    attention = 2 * 2 * 32 * 32 * 128 * 1000 * 1000 / 2
    assert flops == pytest.approx(2 * 8e9 * 1000 + attention)
    device = Device(1000, bf16_tflops=100, int8_tops=200)
    assert prefill_seconds(flops, device, int8=False) == pytest.approx(flops / 100e12)
    assert prefill_seconds(flops, device, int8=True) == pytest.approx(flops / 200e12)
    assert prefill_seconds(flops, Device(1000), int8=False) is None
