"""`recommend` on Phi-3: sizes from the fused tensors (one attn_qkv, an ffn_up twice as tall, the
longrope factor tensors) against the file llama.cpp's quantizer writes."""

from __future__ import annotations

import math

from llmopt.api import recommend
from llmopt.plan.models import from_preset
from llmopt.plan.presets import get_preset
from tests.plan.family_sizes import assert_recommend_gives_llama_cpp_q4_k_m_size
from tests.model.test_phi3 import make_tiny_phi3


def test_recommend_gives_the_size_llama_cpp_writes_for_q4_k_m(tmp_path) -> None:
    """The Q4_K_M file size recommend predicts is the one llama.cpp writes."""
    assert_recommend_gives_llama_cpp_q4_k_m_size(make_tiny_phi3(tmp_path / "phi3", longrope=True), tmp_path, "phi3")


def test_phi3_mini_preset_counts_fused_tensors_once() -> None:
    """microsoft/Phi-3-mini-4k-instruct's "3.8B": 32 x (3·3072² qkv + 3072² o + 2·8192·3072 gate_up +
    8192·3072 down + 2·3072 norms) + 2 · 32064·3072 (untied) + 3072 = 3,821,079,552."""
    model = from_preset(get_preset("phi-3-mini"))
    assert model.parameters == 3_821_079_552
    assert "blk.0.attn_qkv.weight" in {t.gguf_name for t in model.tensors}


def test_recommend_gives_the_tensor_bytes_of_our_gptq_checkpoint(tmp_path) -> None:
    """GPTQ 4-bit g128 of the fused layout: one qweight/qzeros/scales/g_idx per qkv_proj and
    gate_up_proj, byte for byte what `quantize` writes."""
    from safetensors import safe_open

    from llmopt.api import quantize

    hf = make_tiny_phi3(tmp_path / "phi3")
    quantize(hf, tmp_path / "gptq", method="rtn", bits=4, group_size=128)
    itemsize = {"I32": 4, "F16": 2, "F32": 4}
    with safe_open(str(tmp_path / "gptq" / "model.safetensors"), "pt") as f:
        written = sum(math.prod(f.get_slice(k).get_shape()) * itemsize[f.get_slice(k).get_dtype()] for k in f.keys())
    row = next(r for r in recommend(mem=8, model=str(hf))["rows"] if r.format == "GPTQ-4bit-g128")
    assert row.weights_bytes == written
