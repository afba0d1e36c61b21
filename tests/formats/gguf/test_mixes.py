"""The type map of every mix equals the one llama.cpp's quantizer plans (its --dry-run), shape by shape."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmopt.errors import InputError
from llmopt.formats.gguf.mixes import MIXES, file_type, plan_shapes, requires_imatrix, tensor_type, use_more_bits
from llmopt.formats.gguf.types import tensor_nbytes
from llmopt.model.arch import ArchSpec
from llmopt.model.families import LLAMA, QWEN2
from tests.formats.gguf.llama_cpp_helpers import dense_shapes, llama_dry_run_types, llama_quantize, write_sparse_f16_gguf

# name: (family, hidden, ffn, layers, heads, kv_heads, vocab, tied, qkv bias)
SHAPES = {
    "smollm2": (LLAMA, 576, 1536, 30, 9, 3, 49152, True, False),  # every 576-col tensor falls back
    "llama-256": (LLAMA, 256, 512, 16, 8, 2, 512, False, False),  # everything K-quantizable, GQA 4
    "qwen2-bias": (QWEN2, 512, 1408, 24, 16, 2, 640, True, True),  # ffn_down cols 1408: fallback
    "llama-70b": (LLAMA, 256, 512, 80, 8, 1, 256, False, False),  # llama.cpp's 70B attn_v rule
}


def arch_and_shapes(key: str) -> tuple[ArchSpec, dict[str, tuple[int, ...]]]:
    family, hidden, ffn, layers, heads, kv_heads, vocab, tied, bias = SHAPES[key]
    arch = ArchSpec(family=family, hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                    head_dim=hidden // heads, intermediate_size=ffn, vocab_size=vocab, max_position_embeddings=512,
                    rope_theta=1e4, rms_norm_eps=1e-5, tie_word_embeddings=tied, attention_bias=bias)
    shapes = dense_shapes(hidden=hidden, ffn=ffn, layers=layers, heads=heads, kv_heads=kv_heads, vocab=vocab,
                          tie=tied, qkv_bias=bias)
    return arch, shapes


@pytest.fixture(scope="module")
def sparse_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[ArchSpec, dict, Path]]:
    out = {}
    for key in SHAPES:
        arch, shapes = arch_and_shapes(key)
        path = tmp_path_factory.mktemp("mix") / f"{key}.gguf"
        write_sparse_f16_gguf(path, shapes, arch=arch.family.gguf_arch, hidden=arch.hidden_size,
                              ffn=arch.intermediate_size, layers=arch.num_layers, heads=arch.num_heads,
                              kv_heads=arch.num_kv_heads)
        out[key] = (arch, shapes, path)
    return out


def expected_from_llama(types: dict[str, str], shapes: dict[str, tuple[int, ...]]) -> dict[str, str]:
    # llama.cpp keeps unquantized tensors in their source type (F32 1-D, F16 matrices in an F16 file)
    return {name: types[name] for name in shapes}


@pytest.mark.parametrize("key", list(SHAPES))
@pytest.mark.parametrize("mix", [m for m in MIXES if m != "BF16"])
def test_mix_matches_llama_cpp(sparse_models, key: str, mix: str) -> None:
    arch, shapes, path = sparse_models[key]
    ours = plan_shapes(shapes, mix, arch)
    theirs = expected_from_llama(llama_dry_run_types(path, mix), shapes)
    assert ours == theirs


@pytest.mark.parametrize("mix", ["Q4_0", "Q5_0", "Q4_K_M", "Q2_K", "IQ4_XS", "IQ4_NL", "IQ3_XXS", "IQ3_M", "IQ2_XXS",
                                 "IQ2_M", "IQ1_S", "IQ1_M", "Q2_K_S"])
def test_mix_with_imatrix_matches_llama_cpp(sparse_models, mix: str) -> None:
    arch, shapes, path = sparse_models["llama-256"]
    ours = plan_shapes(shapes, mix, arch, has_imatrix=True)
    assert ours == expected_from_llama(llama_dry_run_types(path, mix, imatrix={}), shapes)
    if mix == "Q4_0":  # the imatrix rule: first eighth of ffn_down gets Q4_1
        assert ours["blk.0.ffn_down.weight"] == "Q4_1" and ours["blk.2.ffn_down.weight"] == "Q4_0"
    if mix == "IQ4_XS":  # the rule without one: first eighth of ffn_down gets Q5_K
        assert ours["blk.0.ffn_down.weight"] == "IQ4_XS"
        assert plan_shapes(shapes, mix, arch)["blk.0.ffn_down.weight"] == "Q5_K"


@pytest.mark.parametrize("mix", ["IQ3_XXS", "IQ3_XS", "IQ3_S", "IQ3_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ1_S",
                                 "IQ1_M", "Q2_K_S", "Q2_K"])
def test_imatrix_requirement_matches_llama_cpp(sparse_models, tmp_path, mix: str) -> None:
    """llama-quantize refuses a plan with a very-low-bit i-quant tensor (not token_embd/output) and no
    imatrix; `requires_imatrix` says the same for our plan of the model."""
    arch, shapes, path = sparse_models["llama-256"]
    ours = any(requires_imatrix(name, t, mix) for name, t in plan_shapes(shapes, mix, arch).items())
    try:
        llama_quantize(path, tmp_path / "out.gguf", mix)
        theirs = False
    except AssertionError:  # llama_model_quantize returned an error
        theirs = True
    assert ours == theirs


@pytest.mark.parametrize(
    "overrides",
    [[("attn_v", "Q8_0")], [(r"blk\.[0-3]\.attn_v", "Q2_K"), ("ffn_down", "Q5_0")], [("ffn_up", "Q4_K")]],
)
@pytest.mark.parametrize("key", ["llama-256", "smollm2"])
def test_overrides_match_llama_cpp(sparse_models, key: str, overrides) -> None:
    arch, shapes, path = sparse_models[key]
    ours = plan_shapes(shapes, "Q4_K_M", arch, overrides=overrides)
    assert ours == expected_from_llama(llama_dry_run_types(path, "Q4_K_M", overrides=overrides), shapes)


@pytest.mark.parametrize("key", ["llama-256", "smollm2"])
def test_output_tensor_type_matches_llama_cpp(sparse_models, key: str) -> None:
    arch, shapes, path = sparse_models[key]
    ours = plan_shapes(shapes, "Q3_K_M", arch, output_tensor_type="Q5_K")
    assert ours == expected_from_llama(llama_dry_run_types(path, "Q3_K_M", output_tensor_type="Q5_K"), shapes)


def test_bf16_mix_keeps_matrices_bf16() -> None:
    arch, shapes = arch_and_shapes("llama-256")
    plan = plan_shapes(shapes, "BF16", arch)
    assert plan["blk.3.attn_q.weight"] == "BF16" and plan["output_norm.weight"] == "F32"


def test_known_assignments() -> None:
    arch, shapes = arch_and_shapes("smollm2")
    plan = plan_shapes(shapes, "Q4_K_M", arch)
    assert plan["token_embd.weight"] == "Q8_0"  # tied output rule: 576 cols cannot be Q6_K
    assert plan["blk.0.attn_q.weight"] == "Q5_0"  # Q4_K falls back on 576 columns
    assert plan["blk.0.ffn_down.weight"] == "Q6_K" and plan["blk.4.ffn_down.weight"] == "Q4_K"
    assert plan["blk.0.attn_norm.weight"] == "F32"
    assert tensor_type("blk.3.attn_v.weight", (64, 256), "Q3_K_M", arch) == "Q4_K"
    assert tensor_type("blk.1.attn_v.weight", (64, 256), "Q3_K_M", arch) == "Q5_K"


def test_use_more_bits_follows_c_integer_division() -> None:
    # n=30: first 3, last 4 (>= 26), and (i - 3) % 3 == 2 in C (negative i - 3 never matches)
    assert [i for i in range(30) if use_more_bits(i, 30)] == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]


def test_file_type_and_unknown_mix() -> None:
    assert file_type("Q4_K_M") == 15 and file_type("q8_0") == 7 and file_type("BF16") == 32
    with pytest.raises(InputError):
        file_type("Q4_K_XL")


@pytest.mark.parametrize(
    ("type_name", "shape", "nbytes"),
    [("F32", (576,), 2304), ("F16", (3, 4), 24), ("Q8_0", (2, 64), 2 * 2 * 34), ("Q4_K", (10, 512), 10 * 2 * 144),
     ("Q6_K", (576, 1536), 576 * 6 * 210), ("Q2_K", (1, 256), 84), ("Q3_K", (1, 256), 110), ("Q5_K", (1, 256), 176),
     ("Q4_0", (1, 32), 18), ("Q4_1", (1, 32), 20), ("Q5_0", (1, 32), 22), ("Q5_1", (1, 32), 24), ("BF16", (7,), 14),
     ("IQ1_S", (2, 512), 2 * 2 * 50), ("IQ1_M", (1, 256), 56), ("Q1_0", (3, 128), 3 * 18)],
)
def test_tensor_nbytes(type_name: str, shape, nbytes: int) -> None:
    assert tensor_nbytes(type_name, shape) == nbytes


def test_tensor_nbytes_rejects_partial_blocks() -> None:
    with pytest.raises(InputError):
        tensor_nbytes("Q4_K", (4, 576))
