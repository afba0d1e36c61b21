"""What distinguishes one decoder family from another, and the HF <-> GGUF tensor names they share.

All supported families are Llama-shaped decoders (RMSNorm, rotary attention with GQA, SwiGLU MLP);
they differ in names, biases and whether llama.cpp permutes the Q/K rows.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

# Per-block tensors: HF suffix after "model.layers.{i}." -> GGUF suffix after "blk.{i}.".
BLOCK_TENSORS: dict[str, str] = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
GLOBAL_TENSORS: dict[str, str] = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
# Tensors that exist in GGUF files only and have no HF counterpart (llama3 rope factors are
# recomputed from config.json by every HF reader).
GGUF_ONLY = {"rope_freqs.weight"}

_HF_BLOCK = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_GGUF_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")
_GGUF_TO_HF_BLOCK = {v: k for k, v in BLOCK_TENSORS.items()}
_GGUF_TO_HF_GLOBAL = {v: k for k, v in GLOBAL_TENSORS.items()}


@dataclass(frozen=True)
class Family:
    name: str
    hf_architectures: tuple[str, ...]
    hf_model_type: str
    gguf_arch: str
    permute_qk: bool  # llama.cpp's "llama" arch stores Q/K rows interleaved per head (rope layout)
    qkv_bias: bool = False
    reads_gguf: bool = True  # False when another family owns the GGUF arch name (mistral -> llama)

    def hf_to_gguf_name(self, hf_name: str) -> str | None:
        """llama.cpp's name for an HF tensor, or None for tensors GGUF does not store."""
        if hf_name in GLOBAL_TENSORS:
            return GLOBAL_TENSORS[hf_name]
        m = _HF_BLOCK.match(hf_name)
        if m and m.group(2) in BLOCK_TENSORS:
            return f"blk.{m.group(1)}.{BLOCK_TENSORS[m.group(2)]}"
        return None

    def gguf_to_hf_name(self, gguf_name: str) -> str | None:
        """The HF name of a GGUF tensor, or None for GGUF-only tensors such as rope_freqs."""
        if gguf_name in _GGUF_TO_HF_GLOBAL:
            return _GGUF_TO_HF_GLOBAL[gguf_name]
        m = _GGUF_BLOCK.match(gguf_name)
        if m and m.group(2) in _GGUF_TO_HF_BLOCK:
            return f"model.layers.{m.group(1)}.{_GGUF_TO_HF_BLOCK[m.group(2)]}"
        return None

    def qk_heads(self, hf_name: str, num_heads: int, num_kv_heads: int) -> int | None:
        """Heads to permute over if this tensor is stored permuted in GGUF, else None."""
        if not self.permute_qk:
            return None
        if ".self_attn.q_proj." in hf_name:
            return num_heads
        if ".self_attn.k_proj." in hf_name:
            return num_kv_heads
        return None


def permute_for_gguf(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF rows (halves of each head: [re..., im...]) -> llama.cpp rows (pairs: re, im, re, im)."""
    rows = t.shape[0]
    return t.reshape(n_heads, 2, rows // n_heads // 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def unpermute_from_gguf(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of `permute_for_gguf`."""
    rows = t.shape[0]
    return t.reshape(n_heads, rows // n_heads // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)
