"""Qwen2-MoE in GGUF: the file we write is llama.cpp's "qwen2moe" architecture (expert_count,
expert_used_count, expert_feed_forward_length, expert_shared_feed_forward_length), the router as
ffn_gate_inp (F32), the experts stacked as ffn_{gate,up,down}_exps, the shared expert as
ffn_{gate,up,down}_shexp and its gate as ffn_gate_inp_shexp, as llama.cpp's converter writes it;
llama.cpp runs it with our top choices and our greedy tokens, and GGUF -> HF -> GGUF keeps every tensor."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import transformers

from llmopt.api import convert_to_gguf, convert_to_hf
from llmopt.errors import InputError
from llmopt.formats.gguf.mixes import CLASSIC_MIXES, plan_shapes
from llmopt.model import open_model
from llmopt.model.decoder import Decoder
from llmopt.runtime.generate import Generator
from llmopt.runtime.weights import load_model
from tests.formats.gguf.llama_cpp_helpers import (assert_same_greedy, assert_same_tensors, assert_same_top1,
                                                  assert_type_map_equals_llama_quantize, llama_cpp_greedy, llama_cpp_logits,
                                                  llama_dry_run_types, write_sparse_f16_gguf)
from tests.model.test_qwen2moe import EXPERTS, PER_TOKEN, ids, make_tiny_qwen2moe


@pytest.fixture(scope="module")
def qwen2moe(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_qwen2moe(tmp_path_factory.mktemp("qwen2moe") / "m")


@pytest.fixture(scope="module")
def f16(qwen2moe, tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("qwen2moe_gguf") / "m.gguf"
    convert_to_gguf(qwen2moe, out, "F16")
    return out


def test_our_gguf_has_llama_cpp_names_and_keys(qwen2moe, f16) -> None:
    reader = gguf.GGUFReader(str(f16))
    tensors = {t.name: t for t in reader.tensors}
    assert "blk.0.ffn_gate.weight" not in tensors and "blk.0.attn_q.bias" in tensors
    assert tensors["blk.1.ffn_down_exps.weight"].shape.tolist() == [256, 256, EXPERTS]  # ne: [cols, rows, experts]
    assert tensors["blk.1.ffn_down_shexp.weight"].shape.tolist() == [1024, 256]
    assert tensors["blk.1.ffn_gate_inp_shexp.weight"].shape.tolist() == [256, 1]
    assert tensors["blk.0.ffn_gate_inp.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert tensors["blk.0.ffn_up_exps.weight"].tensor_type == gguf.GGMLQuantizationType.F16
    assert tensors["blk.0.ffn_up_shexp.weight"].tensor_type == gguf.GGMLQuantizationType.F16
    fields = {f.name: f.contents() for f in reader.fields.values() if f.name.startswith("qwen2moe.expert")}
    assert fields == {"qwen2moe.expert_count": EXPERTS, "qwen2moe.expert_used_count": PER_TOKEN,
                      "qwen2moe.expert_feed_forward_length": 256, "qwen2moe.expert_shared_feed_forward_length": 1024}
    assert reader.fields["general.architecture"].contents() == "qwen2moe"
    with open_model(qwen2moe) as hf, open_model(f16) as src:
        assert src.arch.family.name == "qwen2moe" and set(src.tensors) == set(hf.tensors)
        assert (src.arch.extra["expert_ffn"], src.arch.extra["shared_expert_ffn"]) == (256, 1024)
        stacked = torch.from_numpy(np.array(tensors["blk.0.ffn_gate_exps.weight"].data)).float()
        assert torch.equal(stacked[37], hf.load("model.layers.0.mlp.experts.37.gate_proj.weight").half().float())


def test_our_gguf_runs_in_llama_cpp_with_our_top1(f16) -> None:
    """64 positions: llama.cpp's most likely next token on our F16 GGUF equals our decoder's."""
    x = ids(64, seed=5)
    with open_model(f16) as src, torch.no_grad():
        ours = Decoder.from_source(src)(x)[0]
    theirs = llama_cpp_logits(f16, x[0].tolist())
    assert_same_top1(ours, theirs, "qwen2moe F16, 64 positions")


def test_greedy_on_our_gguf_matches_llama_cpp(f16) -> None:
    """32 greedy tokens on our F16 GGUF: llmopt's runtime (weights read from the expert stacks) and llama.cpp's."""
    prompt = ids(12, seed=4)[0].tolist()
    runtime = load_model(str(f16), "float32", "cpu")
    ours = Generator(runtime.model, eos=set()).generate(prompt, max_tokens=32, ignore_eos=True).token_ids
    assert_same_greedy(f16, prompt, ours, llama_cpp_greedy(f16, prompt, 32))


def test_gguf_to_hf_to_gguf_keeps_every_tensor(f16, tmp_path) -> None:
    """F16 GGUF -> HF (one tensor per expert again) -> F16 GGUF: the same tensors, bit for bit; the HF
    directory loads in transformers as Qwen2MoeForCausalLM with our logits."""
    second = tmp_path / "b.gguf"
    convert_to_hf(f16, tmp_path / "hf", dtype="float32")  # F32 norms and routers stay exact
    convert_to_gguf(tmp_path / "hf", second, "F16")
    assert_same_tensors(f16, second)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(ref).__name__ == "Qwen2MoeForCausalLM" and ref.config.num_experts == EXPERTS
    assert ref.config.moe_intermediate_size == 256 and ref.config.shared_expert_intermediate_size == 1024
    assert not ref.config.norm_topk_prob
    x = ids(32)
    with open_model(tmp_path / "hf") as src, torch.no_grad():
        diff = (Decoder.from_source(src)(x) - ref(x).logits).abs().max().item()
    assert diff < 1e-4, diff


@pytest.mark.parametrize("mix", ["Q4_K_M", "Q2_K"])
def test_written_type_map_equals_llama_quantize(qwen2moe, tmp_path, mix: str) -> None:
    """The types in our Q4_K_M / Q2_K file (expert stacks and shared expert quantized, router and
    shared-expert gate in float) equal those llama.cpp's quantizer plans for our F16 file."""
    assert_type_map_equals_llama_quantize(qwen2moe, tmp_path, mix)


def test_renormalised_routing_is_not_written_as_gguf(tmp_path) -> None:
    """llama.cpp's qwen2moe graph never renormalises the top-k weights: such a model is refused in one line."""
    path = make_tiny_qwen2moe(tmp_path / "m", layers=1, norm_topk_prob=True)
    with pytest.raises(InputError, match="norm_topk_prob"):
        convert_to_gguf(path, tmp_path / "m.gguf", "F16")
    assert not (tmp_path / "m.gguf").exists()


@pytest.mark.parametrize("mix", [m for m in CLASSIC_MIXES if m not in ("F16", "BF16")] + ["IQ4_XS", "IQ4_NL", "MXFP4_MOE"])
def test_expert_rules_match_llama_cpp_on_24_layers(tmp_path, mix: str) -> None:
    """A Qwen1.5-MoE-A2.7B-shaped file (24 layers, 60 experts, 4 per token, no GQA, head_dim 128,
    experts 1408 wide as published, so their ffn_down rows fall back) narrowed to 512 wide, without
    data: every IQ-free mix's types, shared expert and its [hidden, 1] gate included, against
    llama.cpp's dry run (the 24 layers reach its per-layer ffn_down and attn_v rules)."""
    from llmopt.model.arch import ArchSpec
    from llmopt.model.families.qwen2moe import QWEN2MOE

    arch = ArchSpec(family=QWEN2MOE, hidden_size=512, num_layers=24, num_heads=4, num_kv_heads=4, head_dim=128,
                    intermediate_size=5632, vocab_size=512, max_position_embeddings=4096, rope_theta=1e6,
                    rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=True,
                    extra={"num_experts": 60, "experts_per_token": 4, "expert_ffn": 1408, "shared_expert_ffn": 5632})  # fmt: skip
    shapes = {"token_embd.weight": (512, 512)}
    for i in range(arch.num_layers):
        shapes.update({gguf_name: shape for _, gguf_name, shape, _ in QWEN2MOE.tensor_shapes(arch, i)})
    shapes.update({"output_norm.weight": (512,), "output.weight": (512, 512)})
    assert shapes["blk.3.ffn_down_exps.weight"] == (60, 512, 1408) and shapes["blk.3.ffn_gate_inp_shexp.weight"] == (1, 512)
    path = write_sparse_f16_gguf(tmp_path / "qwen2moe.gguf", shapes, arch="qwen2moe", hidden=512, ffn=5632, layers=24,
                                 heads=4, kv_heads=4, experts=(60, 4))  # fmt: skip
    ours = plan_shapes(shapes, mix, arch)
    assert ours["blk.0.ffn_gate_inp.weight"] == "F32" and ours["blk.0.ffn_gate_inp_shexp.weight"] == "F32"
    assert ours == llama_dry_run_types(path, mix)
