"""Weight bytes per format: GGUF from the shared mix rules, GPTQ/AWQ from their packed layouts."""

import math
from collections import Counter

import pytest
import torch

from llmopt.formats.gguf.mixes import MIXES, plan_shapes
from llmopt.formats.gguf.types import tensor_nbytes
from llmopt.plan.arch_tensors import PlannedTensors, arch_tensors
from llmopt.plan.presets import PRESETS, get_preset
from llmopt.plan.weights import awq_format, gguf_format, gguf_tensor_types, gptq_format, weight_size


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_gptq_linear_holds_qweight_qzeros_scales_and_g_idx():
    # The GPTQ checkpoint layout (REFERENCE 6.3), built as real tensors for one 4096x11008 down_proj.
    arch = get_preset("llama-2-7b").arch
    tensors = PlannedTensors(t for t in arch_tensors(arch) if t.hf_name == "model.layers.0.mlp.down_proj.weight")
    out_f, in_f = tensors[0].shape
    for bits in (4, 8):
        groups = math.ceil(in_f / 128)
        layout = (torch.empty(in_f * bits // 32, out_f, dtype=torch.int32),
                  torch.empty(groups, out_f * bits // 32, dtype=torch.int32),
                  torch.empty(groups, out_f, dtype=torch.float16), torch.empty(in_f, dtype=torch.int32))
        assert weight_size(arch, tensors, gptq_format(bits)).total_bytes == nbytes(*layout)


def test_awq_linear_holds_qweight_qzeros_scales():
    arch = get_preset("llama-2-7b").arch
    tensors = PlannedTensors(t for t in arch_tensors(arch) if t.hf_name == "model.layers.0.self_attn.k_proj.weight")
    out_f, in_f = tensors[0].shape
    layout = (torch.empty(in_f, out_f // 8, dtype=torch.int32), torch.empty(in_f // 128, out_f // 8, dtype=torch.int32),
              torch.empty(in_f // 128, out_f, dtype=torch.float16))
    assert weight_size(arch, tensors, awq_format(4)).total_bytes == nbytes(*layout)


def test_gptq_keeps_embeddings_head_and_norms_in_fp16():
    arch = get_preset("qwen2.5-0.5b").arch  # biases on q/k/v, tied embeddings
    tensors = arch_tensors(arch)
    size = weight_size(arch, tensors, gptq_format(4))
    floats = sum(t.numel for t in tensors if t.role not in ("linear", "expert"))
    assert size.types["F16"] == 2 * floats
    assert size.total_bytes == size.types["F16"] + size.types["int4+fp16 scales"]


def test_gguf_bytes_are_the_sum_of_each_tensors_planned_type():
    arch = get_preset("smollm2-135m").arch
    tensors = arch_tensors(arch)
    size = weight_size(arch, tensors, gguf_format("Q4_K_M"))
    types = gguf_tensor_types(arch, tensors, "Q4_K_M")
    assert size.total_bytes == sum(tensor_nbytes(types[t.gguf_name], t.shape) for t in tensors)
    assert types["blk.0.attn_norm.weight"] == "F32"


@pytest.mark.parametrize("preset", PRESETS)  # every layer count a preset has (30 to 126, 80 with the 70B bump)
def test_sizing_by_tensor_class_equals_sizing_tensor_by_tensor(preset):
    # recommend sizes llama.cpp's tensor classes once each (layers grouped by `layer_signature`);
    # the rules applied tensor by tensor with the real counters, in loader order (the path an
    # override takes: one that matches nothing), must give the same types and bytes under every mix
    arch = get_preset(preset).arch
    tensors = arch_tensors(arch)
    for mix in MIXES:
        size = weight_size(arch, tensors, gguf_format(mix))
        types = plan_shapes({t.gguf_name: t.shape for t in tensors}, mix, arch, overrides=[("^never$", "F16")])
        types.update({t.gguf_name: "F32" for t in tensors if t.role == "router"})
        assert types == gguf_tensor_types(arch, tensors, mix), mix
        assert size.type_counts == Counter((types[t.gguf_name], t.shape) for t in tensors), mix
        assert size.total_bytes == sum(tensor_nbytes(types[t.gguf_name], t.shape) for t in tensors), mix


def test_q4_k_m_on_llama31_8b_is_4_89_bits_per_weight():
    # llama.cpp's Q4_K_M of Llama-3.1-8B is 4.89 bits/weight (the upgrades push it above Q4_K's 4.5).
    arch = get_preset("llama-3.1-8b").arch
    assert round(weight_size(arch, arch_tensors(arch), gguf_format("Q4_K_M")).bits_per_weight, 2) == 4.89


def test_mixtral_router_stays_f32_and_experts_are_counted():
    arch = get_preset("mixtral-8x7b").arch
    size = weight_size(arch, arch_tensors(arch), gguf_format("Q4_K_M"))
    assert gguf_tensor_types(arch, arch_tensors(arch), "Q4_K_M")["blk.0.ffn_gate_inp.weight"] == "F32"
    assert 0.9 * size.total_bytes < size.expert_bytes < size.total_bytes
