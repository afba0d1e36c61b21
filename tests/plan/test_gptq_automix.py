"""`quantize --target-bpw`: per-stage bits and group size, written as GPTQModel's `dynamic`."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors import safe_open

from llmopt.api.quantize import quantize
from llmopt.errors import OptionError
from llmopt.plan.gptq_automix import module_nbytes
from llmopt.plan.sensitivity import cache_path
from llmopt.model import open_model
from tests.factories import CORPUS


@pytest.fixture
def calib(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text(CORPUS)
    return str(path)


def _override(qc: dict, module: str) -> tuple[int, int]:
    """GPTQModel's rule, restated: the first `+:` pattern that re.match-es the module name wins."""
    for pattern, o in qc.get("dynamic", {}).items():
        if not pattern.startswith("-:") and re.match(pattern.removeprefix("+:"), module):
            return o.get("bits", qc["bits"]), o.get("group_size", qc["group_size"])
    return qc["bits"], qc["group_size"]


def test_target_bpw_mixes_bits_within_budget_and_reads_back(tiny_models, tmp_path, calib) -> None:
    model = tiny_models("llama")
    out = tmp_path / "q"
    steps = []
    result = quantize(model, out, method="gptq", bits=4, group_size=32, calib=calib, nsamples=4, seqlen=48,
                      target_bpw=3.6, sensitivity_samples=2, on_step=lambda *a: steps.append(a))  # fmt: skip
    layers = 2  # the Fisher pass's progress: each block forward, the head, each block backward, the embedding
    assert steps == [("fisher", i, 2 * layers + 2) for i in range(1, 2 * layers + 3)]
    mix = result.automix
    assert mix is not None and mix.bits_per_weight <= 3.6 and mix.predicted_kld > 0
    assert len(mix.counts) >= 2  # a mix, not one setting
    assert cache_path(out).is_file()
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["bits"] == 4 and qc["group_size"] == 32 and qc["dynamic"]
    stored = weights = 0
    with open_model(out) as q, open_model(model) as src, safe_open(str(out / "model.safetensors"), "pt") as f:
        for module, (out_f, in_f) in q.modules.items():
            bits, group_size = _override(qc, module)
            assert (bits, group_size) == mix.dynamic.get(module, (4, 32)), module
            assert f.get_tensor(f"{module}.qweight").shape == (in_f * bits // 32, out_f)
            assert f.get_tensor(f"{module}.scales").shape == (-(-in_f // group_size), out_f)
            qt = q.quantized(module)
            assert (qt.bits, qt.group_size) == (bits, group_size)
            w = src.load(f"{module}.weight")
            assert (q.load(f"{module}.weight") - w).norm() < 0.9 * w.norm()  # a rounding of it, not noise
            stored += module_nbytes(out_f, in_f, bits, group_size)
            weights += out_f * in_f
        for layer in range(2):  # q/k/v and gate/up share one setting: vLLM fuses them
            for group in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")):
                assert len({_override(qc, f"model.layers.{layer}.{m}") for m in group}) == 1
                fused = {"self_attn.q_proj": "self_attn.qkv_proj", "mlp.gate_proj": "mlp.gate_up_proj"}[group[0]]
                assert _override(qc, f"model.layers.{layer}.{fused}") == _override(qc, f"model.layers.{layer}.{group[0]}")
    assert 8 * stored / weights == pytest.approx(mix.bits_per_weight)
    from llmopt.api.generate import generate  # the checkpoint runs in llmopt's runtime

    generated = generate(str(out), "The quick brown fox", max_tokens=4, ignore_eos=True)
    assert len(generated.token_ids) == 4


def test_target_bpw_is_refused_where_it_cannot_be_met(tiny_models, tmp_path, calib) -> None:
    model = tiny_models("llama")
    with pytest.raises(OptionError, match="fewest bits this model's linears take"):
        quantize(model, tmp_path / "a", method="gptq", calib=calib, nsamples=2, seqlen=32, group_size=32,
                 target_bpw=1.0, sensitivity_samples=1)  # fmt: skip
    with pytest.raises(OptionError, match="needs `fmt` gptq"):
        quantize(model, tmp_path / "b", method="awq", calib=calib, nsamples=2, seqlen=32, group_size=32,
                 target_bpw=4.0)  # fmt: skip


def test_cli_target_bpw_bad_input_is_one_line_exit_2(llmopt_here, tiny_models, tmp_path, calib) -> None:
    args = ["quantize", tiny_models("llama"), "--method", "gptq", "--group-size", "32", "--calib", calib,
            "--nsamples", "2", "--seqlen", "32", "--sensitivity-samples", "1"]  # fmt: skip
    low = llmopt_here(*args, "--target-bpw", "1.0", "-o", tmp_path / "a")
    assert low.returncode == 2 and "--target-bpw 1.0: the fewest bits" in low.stderr, low.stderr
    assert len(low.stderr.strip().splitlines()) == 1 and not (tmp_path / "a").exists()
    awq = llmopt_here(*args, "--target-bpw", "4", "--format", "awq", "-o", tmp_path / "b")
    assert awq.returncode == 2 and "needs --format gptq" in awq.stderr, awq.stderr
