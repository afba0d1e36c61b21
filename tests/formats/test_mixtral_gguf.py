"""Mixtral in GGUF: the file we write is llama.cpp's "llama" architecture with expert_count /
expert_used_count, the router as ffn_gate_inp (F32) and each kind of expert linear stacked over the
experts (ffn_gate_exps from w1, ffn_up_exps from w3, ffn_down_exps from w2), as llama.cpp's converter
writes it; llama.cpp runs it with our logits' top choices, and GGUF -> HF -> GGUF keeps every tensor."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import transformers

from llmopt.api import convert_to_gguf, convert_to_hf
from llmopt.formats.gguf.mixes import CLASSIC_MIXES, plan_shapes
from llmopt.model import open_model
from llmopt.model.arch import ArchSpec
from llmopt.model.decoder import Decoder
from llmopt.model.families import MIXTRAL
from tests.formats.gguf.llama_cpp_helpers import (assert_same_tensors, assert_same_top1, assert_type_map_equals_llama_quantize,
                                                  llama_cpp_logits, llama_dry_run_types, write_sparse_f16_gguf)
from tests.model.test_mixtral import EXPERTS, PER_TOKEN, ids, make_tiny_mixtral


def test_our_gguf_runs_in_llama_cpp_with_our_top1(tmp_path) -> None:
    """64 positions: llama.cpp's most likely next token on our F16 GGUF equals our decoder's."""
    path = make_tiny_mixtral(tmp_path / "mixtral")
    out = tmp_path / "mixtral.gguf"
    convert_to_gguf(path, out, "F16")
    reader = gguf.GGUFReader(str(out))
    tensors = {t.name: t for t in reader.tensors}
    assert "blk.0.ffn_gate.weight" not in tensors and "blk.0.ffn_gate_inp.weight" in tensors
    assert tensors["blk.1.ffn_down_exps.weight"].shape.tolist() == [256, 256, EXPERTS]  # ne: [cols, rows, experts]
    assert tensors["blk.0.ffn_gate_inp.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert tensors["blk.0.ffn_up_exps.weight"].tensor_type == gguf.GGMLQuantizationType.F16
    fields = {f.name: f.contents() for f in reader.fields.values() if f.name.startswith("llama.expert")}
    assert fields == {"llama.expert_count": EXPERTS, "llama.expert_used_count": PER_TOKEN}
    x = ids(64, seed=5)
    with open_model(path) as hf, open_model(out) as src, torch.no_grad():
        assert src.arch.family.name == "mixtral" and list(src.tensors) != [] and set(src.tensors) == set(hf.tensors)
        stacked = torch.from_numpy(np.array(tensors["blk.0.ffn_up_exps.weight"].data)).float()
        assert torch.equal(stacked[3], hf.load("model.layers.0.block_sparse_moe.experts.3.w3.weight").half().float())
        ours = Decoder.from_source(src)(x)[0]
    assert_same_top1(ours, llama_cpp_logits(out, x[0].tolist()), "mixtral F16")


def test_gguf_to_hf_to_gguf_keeps_every_tensor(tmp_path) -> None:
    """F16 GGUF -> HF (one tensor per expert again) -> F16 GGUF: the same tensors, bit for bit; the HF
    directory loads in transformers as MixtralForCausalLM with our logits."""
    path = make_tiny_mixtral(tmp_path / "mixtral")
    first, second = tmp_path / "a.gguf", tmp_path / "b.gguf"
    convert_to_gguf(path, first, "F16")
    convert_to_hf(first, tmp_path / "hf", dtype="float32")  # F32 norms and router stay exact
    convert_to_gguf(tmp_path / "hf", second, "F16")
    assert_same_tensors(first, second)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(ref).__name__ == "MixtralForCausalLM" and ref.config.num_local_experts == EXPERTS
    x = ids(32)
    with open_model(tmp_path / "hf") as src, torch.no_grad():
        diff = (Decoder.from_source(src)(x) - ref(x).logits).abs().max().item()
    assert diff < 1e-4, diff


@pytest.mark.parametrize("mix", ["Q4_K_M", "Q2_K"])
def test_written_type_map_equals_llama_quantize(tmp_path, mix: str) -> None:
    """The types in our Q4_K_M / Q2_K file of the random Mixtral (expert stacks quantized, router F32)
    equal those llama.cpp's quantizer plans for our F16 file."""
    assert_type_map_equals_llama_quantize(make_tiny_mixtral(tmp_path / "mixtral"), tmp_path, mix)


@pytest.mark.parametrize("mix", [m for m in CLASSIC_MIXES if m not in ("F16", "BF16")] + ["IQ4_XS", "IQ4_NL", "MXFP4_MOE"])
def test_expert_rules_match_llama_cpp_on_32_layers(tmp_path, mix: str) -> None:
    """A Mixtral-8x7B-shaped file (32 layers, 8 experts, 2 per token, GQA 4, head_dim 128) narrowed to
    1024 wide, without data: llama.cpp's 8-expert rules (attn_k and attn_v to Q8_0, attn_output to Q5_K,
    the router kept in float, MXFP4 for the expert stacks) and its per-layer ffn_down upgrades against its dry run."""
    arch = ArchSpec(family=MIXTRAL, hidden_size=1024, num_layers=32, num_heads=8, num_kv_heads=2, head_dim=128,
                    intermediate_size=3584, vocab_size=512, max_position_embeddings=4096, rope_theta=1e6,
                    rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False,
                    extra={"num_experts": EXPERTS, "experts_per_token": PER_TOKEN})  # fmt: skip
    shapes = {"token_embd.weight": (512, 1024)}
    for i in range(arch.num_layers):
        shapes.update({gguf_name: shape for _, gguf_name, shape, _ in MIXTRAL.tensor_shapes(arch, i)})
    shapes.update({"output_norm.weight": (1024,), "output.weight": (512, 1024)})
    assert shapes["blk.3.ffn_down_exps.weight"] == (EXPERTS, 1024, 3584) and shapes["blk.3.ffn_gate_inp.weight"] == (EXPERTS, 1024)
    path = write_sparse_f16_gguf(tmp_path / "mixtral.gguf", shapes, hidden=1024, ffn=3584, layers=32, heads=8,
                                 kv_heads=2, experts=(EXPERTS, PER_TOKEN))  # fmt: skip
    ours = plan_shapes(shapes, mix, arch)
    assert ours["blk.0.ffn_gate_inp.weight"] == "F32"
    assert ours == llama_dry_run_types(path, mix)


def test_automatic_mix_types_each_expert_stack_whole(tmp_path) -> None:
    """`--target-bpw` on Mixtral: the Fisher pass reaches each expert through its routed tokens (an
    expert no sample reached adds nothing), each stack is priced and typed whole with one importance
    row per expert, the file fits the target, and llama.cpp runs it with our top-1."""
    from tests.factories import CORPUS

    calib = tmp_path / "c.txt"
    calib.write_text(CORPUS)
    path = make_tiny_mixtral(tmp_path / "mixtral")
    out = tmp_path / "auto.gguf"
    result = convert_to_gguf(path, out, target_bpw=4.5, calib=str(calib), sensitivity_samples=4, seqlen=64)
    reader = gguf.GGUFReader(str(out))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert {n for n in types if "_exps" in n} == {f"blk.{i}.ffn_{k}_exps.weight" for i in range(2) for k in ("gate", "up", "down")}
    assert len({types[n] for n in types if "_exps" in n}) > 1, types  # the stacks were chosen for, not one preset
    params = sum(int(np.prod(t.shape)) for t in reader.tensors)
    assert out.stat().st_size <= result["automix"]["target_bytes"] and result["automix"]["target_bytes"] <= params * 4.5 / 8 + 1e6
    x = ids(40, seed=5)
    with open_model(out) as src, torch.no_grad():
        ours = Decoder.from_source(src)(x)[0]
    assert_same_top1(ours, llama_cpp_logits(out, x[0].tolist()), "mixtral automatic mix", atol=0.05)
