"""Phi-3 in GGUF: the file we write stacks q/k/v into `attn_qkv` and gate/up into `ffn_up` as
llama.cpp's converter does, llama.cpp runs it with our logits' top choices, its type map under a
mix equals llama-quantize's, and GGUF -> HF -> GGUF keeps every tensor bit for bit."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import transformers

from llmopt.api import convert_to_gguf, convert_to_hf
from llmopt.formats.gguf.mixes import plan_shapes
from llmopt.model import open_model
from llmopt.model.arch import ArchSpec
from llmopt.model.decoder import Decoder
from llmopt.model.families import PHI3
from llmopt.model.rope import attention_factor
from llmopt.runtime.generate import Generator
from llmopt.runtime.weights import load_model
from tests.formats.gguf.llama_cpp_helpers import (assert_same_greedy, assert_same_tensors, assert_type_map_equals_llama_quantize,
                                                  assert_same_top1, gguf_types, llama_cpp_greedy, llama_cpp_logits,
                                                  llama_dry_run_types, write_sparse_f16_gguf)
from tests.factories import write_reference_gguf
from tests.model.test_phi3 import HEAD_DIM, ids, make_tiny_phi3


@pytest.mark.parametrize("longrope", [False, True], ids=["plain", "longrope"])
def test_our_gguf_runs_in_llama_cpp_with_our_top1(tmp_path, longrope: bool) -> None:
    """64 positions: llama.cpp's most likely next token on our F16 GGUF equals our decoder's. Under
    longrope llama.cpp takes the short factors (n_ctx 128 is within the original 4096) and the
    attention factor from rope.scaling.attn_factor, as transformers and we do."""
    path = make_tiny_phi3(tmp_path / "phi3", longrope=longrope)
    out = tmp_path / "phi3.gguf"
    convert_to_gguf(path, out, "F16")
    reader = gguf.GGUFReader(str(out))
    names = {t.name for t in reader.tensors}
    assert {"blk.0.attn_qkv.weight", "blk.1.ffn_up.weight"} <= names and "blk.0.attn_q.weight" not in names
    assert ("rope_factors_long.weight" in names) == longrope
    x = ids(64, seed=5)
    with open_model(out) as src, torch.no_grad():
        assert src.arch.family.name == "phi3" and (attention_factor(src.arch) > 1) == longrope
        ours = Decoder.from_source(src)(x)[0]
    assert_same_top1(ours, llama_cpp_logits(out, x[0].tolist()), f"phi3 {'longrope' if longrope else 'plain'}")


def test_greedy_on_our_gguf_matches_llama_cpp(tmp_path) -> None:
    """32 greedy tokens on our F16 GGUF: llmopt's runtime (q/k/v and gate/up split from the fused
    tensors) and llama.cpp's."""
    out = convert_to_gguf(make_tiny_phi3(tmp_path / "phi3"), tmp_path / "phi3.gguf", "F16")["output"]
    prompt = ids(12, seed=4)[0].tolist()
    runtime = load_model(str(out), "float32", "cpu")
    ours = Generator(runtime.model, eos=set()).generate(prompt, max_tokens=32, ignore_eos=True).token_ids
    assert_same_greedy(out, prompt, ours, llama_cpp_greedy(out, prompt, 32))


@pytest.mark.parametrize("mix", ["Q4_K_M", "Q2_K"])
def test_written_type_map_equals_llama_quantize(tmp_path, mix: str) -> None:
    """The types in our Q4_K_M / Q2_K file equal those llama.cpp's quantizer plans for our F16 file."""
    assert_type_map_equals_llama_quantize(make_tiny_phi3(tmp_path / "phi3"), tmp_path, mix)


@pytest.mark.parametrize("mix", ["Q4_K_M", "Q2_K", "Q3_K_M", "Q5_K_M", "Q4_K_S"])
def test_mix_rules_for_attn_qkv_match_llama_cpp_on_16_layers(tmp_path, mix: str) -> None:
    """A Phi-3-mini-shaped file (3072 wide, head_dim 96, no GQA) of 16 layers, without data: the
    attn_qkv and ffn_up rules and their per-layer counters against llama.cpp's dry run."""
    arch = ArchSpec(family=PHI3, hidden_size=3072, num_layers=16, num_heads=32, num_kv_heads=32, head_dim=HEAD_DIM,
                    intermediate_size=8192, vocab_size=512, max_position_embeddings=4096, rope_theta=1e4,
                    rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False)  # fmt: skip
    shapes = {"token_embd.weight": (512, 3072)}
    for i in range(arch.num_layers):
        shapes.update({gguf_name: shape for _, gguf_name, shape, _ in PHI3.tensor_shapes(arch, i)})
    shapes.update({"output_norm.weight": (3072,), "output.weight": (512, 3072)})
    assert shapes["blk.3.attn_qkv.weight"] == (3 * 3072, 3072) and shapes["blk.3.ffn_up.weight"] == (2 * 8192, 3072)
    path = write_sparse_f16_gguf(tmp_path / "phi3.gguf", shapes, arch="phi3", hidden=3072, ffn=8192, layers=16,
                                 heads=32, kv_heads=32)  # fmt: skip
    assert plan_shapes(shapes, mix, arch) == llama_dry_run_types(path, mix)


def test_gguf_to_hf_to_gguf_keeps_every_tensor(tmp_path) -> None:
    """F16 GGUF -> HF (fused qkv_proj / gate_up_proj again) -> F16 GGUF: the same tensors, bit for bit;
    the HF directory loads in transformers with our logits."""
    path = make_tiny_phi3(tmp_path / "phi3", longrope=True)
    first, second = tmp_path / "a.gguf", tmp_path / "b.gguf"
    convert_to_gguf(path, first, "F16")
    convert_to_hf(first, tmp_path / "hf", dtype="float32")  # F32 norms stay exact
    convert_to_gguf(tmp_path / "hf", second, "F16")
    assert_same_tensors(first, second)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(ref).__name__ == "Phi3ForCausalLM"
    assert ref.model.layers[0].self_attn.qkv_proj.weight.shape[0] == 3 * ref.config.hidden_size
    x = ids(32)
    with open_model(tmp_path / "hf") as src, torch.no_grad():
        assert src.arch.rope_scaling["rope_type"] == "longrope"
        diff = (Decoder.from_source(src)(x) - ref(x).logits).abs().max().item()
    assert diff < 1e-4, diff


def test_automatic_mix_prices_each_fused_tensor_whole(tmp_path) -> None:
    """--target-bpw on Phi-3: attn_qkv and ffn_up are priced as the stored tensors (their parts' Fisher
    diagonals stacked), get one type each, and the file meets the budget."""
    from tests.factories import CORPUS

    path = make_tiny_phi3(tmp_path / "phi3", heads=4)
    calib = tmp_path / "c.txt"
    calib.write_text(CORPUS)
    out = tmp_path / "auto.gguf"
    convert_to_gguf(path, out, target_bpw=5.0, calib=str(calib), sensitivity_samples=2, nsamples=2, seqlen=32)
    reader = gguf.GGUFReader(str(out))
    params = sum(int(np.prod(t.shape)) for t in reader.tensors)
    assert (out.stat().st_size - reader.data_offset) * 8 <= 5.0 * params  # the tensors within the budget
    types = gguf_types(out)
    assert "blk.0.attn_qkv.weight" in types and "blk.0.attn_q.weight" not in types
    assert len(set(types.values()) - {"F32"}) >= 2, types  # a mix, not one type
    with open_model(out) as q:
        assert torch.isfinite(Decoder.from_source(q)(ids(8))).all()


def test_reads_a_gguf_laid_out_by_llama_cpps_converter(tmp_path) -> None:
    """A file written by tests/factories.py with the gguf package, independently of llmopt, as
    llama.cpp's converter lays Phi-3 out: llmopt reads the converter's layout (split attn_qkv / ffn_up, longrope from the factor tensors
    and attn_factor) as it reads its own F16 file of the same model, and re-writes the very same tensors."""
    path = make_tiny_phi3(tmp_path / "phi3", longrope=True)
    ref_gguf, ours = tmp_path / "ref.gguf", tmp_path / "ours.gguf"
    write_reference_gguf(path, ref_gguf, "F16")
    convert_to_gguf(path, ours, "F16")
    x = ids(40)
    with open_model(ref_gguf) as theirs, open_model(ours) as mine, torch.no_grad():
        assert theirs.arch.rope_scaling["short_factor"] == mine.arch.rope_scaling["short_factor"]
        assert attention_factor(theirs.arch) == pytest.approx(attention_factor(mine.arch), abs=1e-6)
        assert list(theirs.tensors) == list(mine.tensors)
        diff = (Decoder.from_source(theirs)(x) - Decoder.from_source(mine)(x)).abs().max().item()
    assert diff < 1e-5, diff
    again = tmp_path / "again.gguf"
    convert_to_gguf(ref_gguf, again, "F16")
    assert_same_tensors(ref_gguf, again, ordered=False)


def test_longrope_past_the_original_context_runs_in_llama_cpp_with_our_top1(tmp_path) -> None:
    """An original context of 64 and 100 tokens: the file carries what llama.cpp's converter writes
    for longrope (rope_factors_long/short as F32 tensors of the config's factors, rope.scaling.attn_factor
    and original_context_length, context_length the extended one); llama.cpp with a 128-token context
    (past the original) takes the long factors, as transformers and we do for a forward past it, and
    its top-1 on 100 positions is ours."""
    from tests.model.test_phi3 import SHORT_CONTEXT

    path = make_tiny_phi3(tmp_path / "phi3", longrope=True, original=SHORT_CONTEXT)
    out = tmp_path / "phi3.gguf"
    convert_to_gguf(path, out, "F16")
    reader = gguf.GGUFReader(str(out))
    tensors = {t.name: t for t in reader.tensors}
    with open_model(path) as src:
        scaling = src.arch.rope_scaling
        factor = attention_factor(src.arch)
    for name, key in (("rope_factors_long.weight", "long_factor"), ("rope_factors_short.weight", "short_factor")):
        assert tensors[name].tensor_type == gguf.GGMLQuantizationType.F32
        assert np.array_equal(np.asarray(tensors[name].data), np.asarray(scaling[key], dtype=np.float32))
    assert reader.fields["phi3.rope.scaling.original_context_length"].contents() == SHORT_CONTEXT
    assert reader.fields["phi3.context_length"].contents() == 4 * SHORT_CONTEXT
    assert reader.fields["phi3.rope.scaling.attn_factor"].contents() == pytest.approx(factor, rel=1e-6)
    x = ids(100, seed=6)
    with open_model(out) as src, torch.no_grad():
        ours = Decoder.from_source(src)(x)[0]
    assert_same_top1(ours, llama_cpp_logits(out, x[0].tolist(), n_ctx=128), "phi3 longrope past the original context")


@pytest.mark.parametrize("longrope", [False, True], ids=["plain", "longrope"])
def test_phi3_keys_are_those_llama_cpps_converter_writes(tmp_path, longrope: bool) -> None:
    """Every phi3.* key of the file laid out as llama.cpp's converter lays it out (the original context
    and the sliding window for every Phi-3; the attention factor under longrope) is in ours, with its
    value; the window reads back."""
    path = make_tiny_phi3(tmp_path / "phi3", longrope=longrope)
    ref_gguf, ours = tmp_path / "ref.gguf", tmp_path / "ours.gguf"
    write_reference_gguf(path, ref_gguf, "F16")
    convert_to_gguf(path, ours, "F16")

    def keys(file):  # noqa: ANN001, ANN202
        fields = gguf.GGUFReader(str(file)).fields
        return {k: f.contents() for k, f in fields.items() if k.startswith("phi3.")}

    theirs, mine = keys(ref_gguf), keys(ours)
    assert "phi3.rope.scaling.original_context_length" in theirs and "phi3.attention.sliding_window" in theirs
    for key, value in theirs.items():
        assert mine.get(key) == pytest.approx(value, rel=1e-6), key
    with open_model(ours) as src:
        assert src.arch.sliding_window == 2047
