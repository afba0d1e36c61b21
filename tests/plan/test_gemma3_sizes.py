"""`recommend` on Gemma 3: sizes from the family's tensors (four norms per block, q/k norms, tied
embedding) against the file llama.cpp's quantizer writes, and the gemma-3-1b preset's count."""

from __future__ import annotations

from llmopt.api import recommend
from llmopt.plan.models import from_preset
from llmopt.plan.presets import get_preset
from tests.plan.family_sizes import assert_recommend_gives_llama_cpp_q4_k_m_size
from tests.model.test_gemma3 import make_tiny_gemma3


def test_recommend_gives_the_size_llama_cpp_writes_for_q4_k_m(tmp_path) -> None:
    """The Q4_K_M file size recommend predicts is the one llama.cpp writes."""
    assert_recommend_gives_llama_cpp_q4_k_m_size(make_tiny_gemma3(tmp_path / "g"), tmp_path, "gemma3")


def test_recommend_sizes_the_language_model_of_a_multimodal_checkpoint(tmp_path) -> None:
    """Gemma3ForConditionalGeneration (4B-style): the text model's Q4_K_M, to the byte llama.cpp writes;
    the vision tower is not counted."""
    from tests.model.test_gemma3_multimodal import make_tiny_gemma3_4b

    assert_recommend_gives_llama_cpp_q4_k_m_size(make_tiny_gemma3_4b(tmp_path / "g"), tmp_path, "gemma3 multimodal")


def test_gemma_3_1b_preset_counts_every_tensor() -> None:
    """google/gemma-3-1b-it's 999,885,952 parameters (1152 wide, 26 layers, head_dim 256, 4 heads and 1
    KV head, 6912-wide GeGLU, 262,144 tokens, tied): 26 x (1152·1024 q + 2·1152·256 k/v + 1024·1152 o +
    3·6912·1152 MLP + 4·1152 norms + 2·256 q/k norms) + 262144·1152 + 1152."""
    model = from_preset(get_preset("gemma-3-1b"))
    assert model.parameters == 999_885_952
    assert "blk.0.post_ffw_norm.weight" in {t.gguf_name for t in model.tensors}


def test_kv_cache_keeps_only_the_window_on_sliding_layers() -> None:
    """gemma-3-1b at 32,768 tokens: 4 global layers keep every token, the 22 sliding ones their 512;
    K and V of one KV head of 256 in f16: 1,024 bytes per layer-token."""
    from llmopt.plan.kv_cache import kv_cache_bytes, kv_bytes_per_token

    arch = get_preset("gemma-3-1b").arch
    assert kv_cache_bytes(arch, 32768) == 1024 * (4 * 32768 + 22 * 512) == 145_752_064
    assert kv_cache_bytes(arch, 300, batch=2) == 2 * kv_bytes_per_token(arch) * 300  # within the window: every layer
    info = recommend(mem=8, model="gemma-3-1b", context=32768)["models"][0]
    assert info["kv_cache_bytes"] == 145_752_064
