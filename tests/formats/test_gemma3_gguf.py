"""Gemma 3 in GGUF: the file we write (norms stored as 1 + w, post-attention/pre-/post-FFN norms
under llama.cpp's names, the sliding window key) runs in llama.cpp with our logits and our greedy
tokens, its type map under a mix equals llama-quantize's, and GGUF -> HF -> GGUF keeps every tensor
bit for bit."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from llmopt.api import convert_to_gguf, convert_to_hf
from llmopt.model import open_model
from llmopt.model.decoder import Decoder
from tests.formats.gguf.llama_cpp_helpers import (assert_same_greedy, assert_same_tensors, assert_same_top1,
                                                  assert_type_map_equals_llama_quantize, llama_cpp_greedy, llama_cpp_logits,
                                                  llama_dry_run_types, write_sparse_f16_gguf)
from tests.model.test_gemma3 import WINDOW, ids, make_tiny_gemma3, reference


def test_written_gguf_has_llama_cpps_layout(tmp_path) -> None:
    """gemma3 names, norms as 1 + w (llama.cpp's converter adds 1 to every norm.weight), and the
    sliding window; reading it back gives transformers' tensors and config."""
    path = make_tiny_gemma3(tmp_path / "g")
    out = tmp_path / "g.gguf"
    convert_to_gguf(path, out, "F16")
    reader = gguf.GGUFReader(str(out))
    tensors = {t.name: t for t in reader.tensors}
    assert {"blk.0.post_attention_norm.weight", "blk.0.ffn_norm.weight", "blk.0.post_ffw_norm.weight",
            "blk.0.attn_q_norm.weight", "blk.0.attn_k_norm.weight"} <= set(tensors)
    assert "output.weight" not in tensors  # tied
    assert reader.fields["general.architecture"].contents() == "gemma3"
    assert reader.fields["gemma3.attention.sliding_window"].contents() == WINDOW
    ref = reference(path)
    stored = np.asarray(tensors["blk.2.ffn_norm.weight"].data)
    assert np.array_equal(stored, (ref.model.layers[2].pre_feedforward_layernorm.weight.detach() + 1).numpy())
    with open_model(out) as src:
        assert src.arch.extra["layer_types"] == ref.config.layer_types
        assert src.arch.extra["rope_local_base_freq"] == 10_000.0 and src.arch.sliding_window == WINDOW
        # w comes back as (1 + w) - 1: float32 rounding of the sum only (exact for bf16 checkpoints)
        back = src.load("model.layers.2.pre_feedforward_layernorm.weight")
        assert torch.allclose(back, ref.model.layers[2].pre_feedforward_layernorm.weight.detach(), rtol=0, atol=1e-7)


def test_our_gguf_runs_in_llama_cpp_with_our_logits(tmp_path) -> None:
    """64 positions (four windows long): llama.cpp's logits on our F16 GGUF are ours, top-1 equal."""
    path = make_tiny_gemma3(tmp_path / "g")
    out = tmp_path / "g.gguf"
    convert_to_gguf(path, out, "F16")
    x = ids(64, seed=5)
    with open_model(out) as src, torch.no_grad():
        ours = Decoder.from_source(src)(x)[0]
    assert_same_top1(ours, llama_cpp_logits(out, x[0].tolist()), "gemma3 (64 positions)")


def test_greedy_generation_equals_llama_cpps(tmp_path) -> None:
    """32 greedy tokens from our runtime (KV cache, decode steps past the window) on the GGUF equal
    llama.cpp's on the same file, from the same prompt ids."""
    from llmopt.runtime.generate import Generator
    from llmopt.runtime.weights import load_model

    path = make_tiny_gemma3(tmp_path / "g")
    out = tmp_path / "g.gguf"
    convert_to_gguf(path, out, "F16")
    prompt = ids(12, seed=7)[0].tolist()
    theirs = llama_cpp_greedy(out, prompt, 32)
    loaded = load_model(str(out), "float32", "cpu")
    ours = Generator(loaded.model, eos=set()).generate(prompt, max_tokens=32, ignore_eos=True).token_ids
    assert len(set(theirs)) >= 3  # a continuation that changes token, not one repeated
    assert_same_greedy(out, prompt, ours, theirs)


@pytest.mark.parametrize("mix", ["Q4_K_M", "Q2_K"])
def test_written_type_map_equals_llama_quantize(tmp_path, mix: str) -> None:
    """The types in our Q4_K_M / Q2_K file equal those llama.cpp's quantizer plans for our F16 file."""
    assert_type_map_equals_llama_quantize(make_tiny_gemma3(tmp_path / "g"), tmp_path, mix)


def test_gguf_to_hf_to_gguf_keeps_every_tensor(tmp_path) -> None:
    """F16 GGUF -> HF -> F16 GGUF: the same tensors bit for bit (the norms' 1 + w as well); the HF
    directory loads in transformers with our logits."""
    import transformers

    path = make_tiny_gemma3(tmp_path / "g")
    first, second = tmp_path / "a.gguf", tmp_path / "b.gguf"
    convert_to_gguf(path, first, "F16")
    convert_to_hf(first, tmp_path / "hf", dtype="float32")
    convert_to_gguf(tmp_path / "hf", second, "F16")
    assert_same_tensors(first, second)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(ref).__name__ == "Gemma3ForCausalLM"
    x = ids(40)
    with open_model(tmp_path / "hf") as src, torch.no_grad():
        diff = (Decoder.from_source(src)(x) - ref(x).logits).abs().max().item()
    assert diff < 1e-4, diff


@pytest.mark.parametrize("mix", ["Q4_K_M", "Q2_K", "Q3_K_M", "Q5_K_M", "Q4_K_S", "Q6_K"])
def test_mix_rules_match_llama_cpp_at_gemma_3_1b_shapes(tmp_path, mix: str) -> None:
    """gemma-3-1b-it's own shapes (26 layers, 1152 wide: K-quant rows fall back; 1 KV head; 262,144-token
    tied embedding) in a file without data: every tensor's type against llama.cpp's dry run."""
    from llmopt.formats.gguf.mixes import plan_shapes
    from llmopt.plan.presets import get_preset

    arch = get_preset("gemma-3-1b").arch
    shapes = {"token_embd.weight": (arch.vocab_size, arch.hidden_size)}
    for i in range(arch.num_layers):
        shapes.update({gguf_name: shape for _, gguf_name, shape, _ in arch.family.tensor_shapes(arch, i)})
    shapes["output_norm.weight"] = (arch.hidden_size,)
    path = write_sparse_f16_gguf(tmp_path / "g.gguf", shapes, arch="gemma3", hidden=1152, ffn=6912, layers=26,
                                 heads=4, kv_heads=1)  # fmt: skip
    assert plan_shapes(shapes, mix, arch) == llama_dry_run_types(path, mix)


def test_reads_a_gguf_laid_out_by_llama_cpps_converter(tmp_path) -> None:
    """A file written by tests/factories.py with the gguf package, independently of llmopt, as
    llama.cpp's Gemma3Model lays it out: llmopt reads it as it reads its own F16 file of the same
    model, and re-writes the very same tensors."""
    from tests.factories import write_reference_gguf

    path = make_tiny_gemma3(tmp_path / "g")
    ref_gguf, ours = tmp_path / "ref.gguf", tmp_path / "ours.gguf"
    write_reference_gguf(path, ref_gguf, "F16")
    convert_to_gguf(path, ours, "F16")
    x = ids(40)
    with open_model(ref_gguf) as theirs, open_model(ours) as mine, torch.no_grad():
        assert theirs.arch == mine.arch and theirs.arch.extra["layer_types"] == mine.arch.extra["layer_types"]
        assert list(theirs.tensors) == list(mine.tensors)
        diff = (Decoder.from_source(theirs)(x) - Decoder.from_source(mine)(x)).abs().max().item()
    assert diff < 1e-5, diff
    again = tmp_path / "again.gguf"
    convert_to_gguf(ref_gguf, again, "F16")
    assert_same_tensors(ref_gguf, again, ordered=False)
