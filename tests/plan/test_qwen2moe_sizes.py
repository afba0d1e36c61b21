"""`recommend` on Qwen2-MoE: sizes from the expert stacks, the shared expert and the float routers
against the files llama.cpp's quantizer and our GPTQ writer produce, and active vs total parameters
(the shared expert is active for every token)."""

from __future__ import annotations

import math

from llmopt.api import quantize, recommend
from llmopt.model import open_model
from tests.model.test_qwen2moe import EXPERTS, PER_TOKEN, make_tiny_qwen2moe
from tests.plan.family_sizes import assert_recommend_gives_llama_cpp_q4_k_m_size


def test_recommend_gives_the_size_llama_cpp_writes_for_q4_k_m(tmp_path) -> None:
    """The Q4_K_M file size recommend predicts is the one llama.cpp writes."""
    assert_recommend_gives_llama_cpp_q4_k_m_size(make_tiny_qwen2moe(tmp_path / "qwen2moe"), tmp_path, "qwen2moe")


def test_active_parameters_count_four_of_sixty_experts_and_the_shared_one(tmp_path) -> None:
    hf = make_tiny_qwen2moe(tmp_path / "qwen2moe")
    with open_model(hf) as src:
        total = src.parameter_count
        experts = sum(t.numel for n, t in src.tensors.items() if ".mlp.experts." in n)
    (model,) = recommend(mem=8, model=str(hf))["models"]
    assert model["family"] == "qwen2moe" and model["experts"] == EXPERTS and model["experts_per_token"] == PER_TOKEN
    assert model["parameters"] == total
    assert model["active_parameters"] == total - experts + experts * PER_TOKEN // EXPERTS


def test_recommend_gives_the_tensor_bytes_of_our_gptq_checkpoint(tmp_path) -> None:
    """GPTQ 4-bit g128: one qweight/qzeros/scales/g_idx per expert and shared-expert linear, the
    router and the shared expert's gate in float, byte for byte what `quantize` writes."""
    from safetensors import safe_open

    hf = make_tiny_qwen2moe(tmp_path / "qwen2moe")
    quantize(hf, tmp_path / "gptq", method="rtn", bits=4, group_size=128)
    itemsize = {"I32": 4, "F16": 2, "F32": 4}
    with safe_open(str(tmp_path / "gptq" / "model.safetensors"), "pt") as f:
        written = sum(math.prod(f.get_slice(k).get_shape()) * itemsize[f.get_slice(k).get_dtype()] for k in f.keys())
    row = next(r for r in recommend(mem=8, model=str(hf))["rows"] if r.format == "GPTQ-4bit-g128")
    assert row.weights_bytes == written


def test_the_a2_7b_preset_has_its_published_totals() -> None:
    """Qwen1.5-MoE-A2.7B's model card: 14.3B parameters, 2.7B of them active per token."""
    (model,) = recommend(mem=24, model="qwen1.5-moe-a2.7b")["models"]
    assert model["family"] == "qwen2moe" and (model["experts"], model["experts_per_token"]) == (60, 4)
    assert round(model["parameters"] / 1e9, 1) == 14.3 and round(model["active_parameters"] / 1e9, 1) == 2.7
