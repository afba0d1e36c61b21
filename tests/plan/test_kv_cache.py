"""KV cache: 2 x layers x kv_heads x head_dim x context x batch x bytes of the KV type."""

import pytest

from llmopt.errors import InputError
from llmopt.plan.kv_cache import kv_bytes_per_token, kv_cache_bytes
from llmopt.plan.presets import get_preset


def test_llama3_70b_at_8k_is_exactly_2_5_gib():
    arch = get_preset("llama-3-70b").arch
    assert kv_cache_bytes(arch, 8192) == 2 * 80 * 8 * 128 * 8192 * 2 == int(2.5 * 2**30)


def test_gqa_counts_kv_heads_not_query_heads():
    l2, l3 = get_preset("llama-2-70b").arch, get_preset("llama-3-70b").arch
    assert l2.num_heads == 64 and l2.num_kv_heads == 8
    assert kv_bytes_per_token(l2) == kv_bytes_per_token(l3) == 2 * 80 * 8 * 128 * 2
    l2_7b = get_preset("llama-2-7b").arch  # no GQA: all 32 heads cached
    assert kv_bytes_per_token(l2_7b) == 2 * 32 * 32 * 128 * 2


def test_batch_and_quantized_caches():
    arch = get_preset("llama-3-8b").arch
    f16 = kv_cache_bytes(arch, 4096, batch=3)
    assert f16 == 3 * kv_cache_bytes(arch, 4096)
    assert kv_cache_bytes(arch, 4096, 3, "bf16") == f16
    assert kv_cache_bytes(arch, 4096, 3, "q8_0") * 64 == f16 * 34  # 34 bytes per 32 values
    assert kv_cache_bytes(arch, 4096, 3, "q4_0") * 64 == f16 * 18


def test_unknown_kv_dtype_names_the_valid_ones():
    with pytest.raises(InputError, match="f16, bf16, q8_0, q4_0"):
        kv_cache_bytes(get_preset("llama-3-8b").arch, 16, kv_dtype="fp8")
