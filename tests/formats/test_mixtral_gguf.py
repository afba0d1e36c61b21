"""Mixtral in GGUF: the file we write is llama.cpp's "llama" architecture with expert_count /
expert_used_count, the router as ffn_gate_inp (F32) and each kind of expert linear stacked over the
experts (ffn_gate_exps from w1, ffn_up_exps from w3, ffn_down_exps from w2), as llama.cpp's converter
writes it; llama.cpp runs it with our logits' top choices, and GGUF -> HF -> GGUF keeps every tensor."""

from __future__ import annotations

import gguf
import numpy as np
import torch
import transformers

from llmopt.api import convert_to_gguf, convert_to_hf
from llmopt.model import open_model
from llmopt.model.decoder import Decoder
from tests.formats.gguf.llama_cpp_helpers import assert_same_tensors, assert_same_top1, llama_cpp_logits
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
