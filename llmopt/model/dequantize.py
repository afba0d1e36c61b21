"""GGML block bytes -> float32 values: the `gguf` package's reference dequantizers, and ours for the
types it has no class for (Q1_0: gguf 0.19 knows the type id and block size, not the values; Q2_0: not
even the type).

One entry point for every reader (`GGUFSource.load`, the runtime's `RawGGUFLinear`), so a type added
here (and named in `ggml_types.PARTS`) is readable everywhere at once.
"""

from __future__ import annotations

import numpy as np
from gguf.quants import dequantize as gguf_dequantize

from llmopt.model.ggml_types import PARTS, GGMLQuantType


def dequantize(data: np.ndarray, qtype: GGMLQuantType) -> np.ndarray:
    """Block bytes [..., bytes per row] of type `qtype` -> float32 [..., values per row]."""
    ours = _OURS.get(qtype.name)
    return gguf_dequantize(data, qtype) if ours is None else ours(np.asarray(data).view(np.uint8))


def _leading_fp16(blocks: np.ndarray) -> np.ndarray:
    """The fp16 scale each block [n, bytes] starts with, as float32 [n, 1]."""
    return blocks[:, :2].copy().view(np.float16).astype(np.float32)


def q1_0(data: np.ndarray) -> np.ndarray:
    """Q1_0 (dequantize_row_q1_0 in ggml-quants.c): 18-byte blocks of an fp16 d and 128 sign bits,
    value j in bit j%8 of byte j/8; w = +d for a set bit, -d otherwise."""
    blocks = data.reshape(-1, 18)
    d = _leading_fp16(blocks)
    signs = np.unpackbits(blocks[:, 2:], axis=-1, bitorder="little").astype(np.float32) * 2.0 - 1.0
    return (d * signs).reshape(*data.shape[:-1], data.shape[-1] // 18 * 128)


def q2_0(data: np.ndarray) -> np.ndarray:
    """Q2_0 (dequantize_row_q2_0 in ggml-quants.c): 18-byte blocks of an fp16 d and 64 two-bit codes,
    value j in bits 2·(j%4) of byte j/4; w = (q - 1)·d."""
    blocks = data.reshape(-1, 18)
    d = _leading_fp16(blocks)
    q = (blocks[:, 2:, None] >> np.array([0, 2, 4, 6], dtype=np.uint8)) & 3
    return (d * (q.reshape(-1, 64).astype(np.float32) - 1.0)).reshape(*data.shape[:-1], data.shape[-1] // 18 * 64)


_OURS = {name: globals()[parts.dequantizer] for name, parts in PARTS.items() if parts.dequantizer}  # as PARTS names them
