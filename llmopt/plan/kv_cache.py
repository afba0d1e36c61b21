"""KV cache bytes: what grows with context and batch, and why GQA matters.

Every layer keeps one K and one V vector per KV head per token: 2 x layers x kv_heads x head_dim
x context x batch elements. With grouped-query attention only the KV heads count (Llama-3-70B keeps
8 of its 64 heads), which is why its cache is 8x smaller than the head count suggests. Quantized
caches store llama.cpp blocks of 32 values (q8_0: 34 bytes, q4_0: 18 bytes) along each row.
"""

from __future__ import annotations

import math

from llmopt.errors import InputError
from llmopt.model.arch import ArchSpec

# KV dtype -> (elements per block, bytes per block)
KV_DTYPES: dict[str, tuple[int, int]] = {"f16": (1, 2), "bf16": (1, 2), "q8_0": (32, 34), "q4_0": (32, 18)}


def check_kv_dtype(name: str) -> str:
    key = name.strip().lower()
    if key not in KV_DTYPES:
        raise InputError(f"unknown KV cache dtype {name!r}; choose one of: {', '.join(KV_DTYPES)}")
    return key


def kv_row_bytes(elements: int, kv_dtype: str) -> int:
    block, nbytes = KV_DTYPES[check_kv_dtype(kv_dtype)]
    return math.ceil(elements / block) * nbytes


def kv_bytes_per_token(arch: ArchSpec, kv_dtype: str = "f16") -> int:
    """K and V of one token in every layer, for one sequence."""
    return 2 * arch.num_layers * kv_row_bytes(arch.num_kv_heads * arch.head_dim, kv_dtype)


def kv_cache_bytes(arch: ArchSpec, context: int, batch: int = 1, kv_dtype: str = "f16") -> int:
    """The whole cache: `batch` sequences of `context` tokens each. A sliding-window layer (Gemma 3's
    five of every six) keeps only its window's tokens (`Family.kv_windows`)."""
    tokens = sum(context if w is None else min(context, w) for w in arch.family.kv_windows(arch))
    return 2 * kv_row_bytes(arch.num_kv_heads * arch.head_dim, kv_dtype) * tokens * batch
