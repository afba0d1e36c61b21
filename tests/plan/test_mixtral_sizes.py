"""`recommend` on Mixtral: sizes from the expert stacks (one [experts, rows, cols] tensor per kind,
the router in F32) against the file llama.cpp's quantizer writes, and active vs total parameters."""

from __future__ import annotations

from llmopt.api import recommend
from llmopt.model import open_model
from tests.model.test_mixtral import EXPERTS, PER_TOKEN, make_tiny_mixtral
from tests.plan.family_sizes import assert_recommend_gives_llama_cpp_q4_k_m_size


def test_recommend_gives_the_size_llama_cpp_writes_for_q4_k_m(tmp_path) -> None:
    """The Q4_K_M file size recommend predicts is the one llama.cpp writes."""
    assert_recommend_gives_llama_cpp_q4_k_m_size(make_tiny_mixtral(tmp_path / "mixtral"), tmp_path, "mixtral")


def test_active_parameters_count_two_of_eight_experts(tmp_path) -> None:
    """Total parameters are every tensor's; active ones leave out the experts a token is not routed to."""
    hf = make_tiny_mixtral(tmp_path / "mixtral")
    with open_model(hf) as src:
        total = src.parameter_count
        experts = sum(t.numel for n, t in src.tensors.items() if ".experts." in n)
    (model,) = recommend(mem=8, model=str(hf))["models"]
    assert model["family"] == "mixtral" and model["experts"] == EXPERTS and model["experts_per_token"] == PER_TOKEN
    assert model["parameters"] == total
    assert model["active_parameters"] == total - experts + experts * PER_TOKEN // EXPERTS


def test_recommend_gives_the_tensor_bytes_of_our_gptq_checkpoint(tmp_path) -> None:
    """GPTQ 4-bit g128: one qweight/qzeros/scales/g_idx per expert linear, the router in float, byte
    for byte what `quantize` writes."""
    import math

    from safetensors import safe_open

    from llmopt.api import quantize

    hf = make_tiny_mixtral(tmp_path / "mixtral")
    quantize(hf, tmp_path / "gptq", method="rtn", bits=4, group_size=128)
    itemsize = {"I32": 4, "F16": 2, "F32": 4}
    with safe_open(str(tmp_path / "gptq" / "model.safetensors"), "pt") as f:
        written = sum(math.prod(f.get_slice(k).get_shape()) * itemsize[f.get_slice(k).get_dtype()] for k in f.keys())
    row = next(r for r in recommend(mem=8, model=str(hf))["rows"] if r.format == "GPTQ-4bit-g128")
    assert row.weights_bytes == written
