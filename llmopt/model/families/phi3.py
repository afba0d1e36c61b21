"""Phi-3 (mini, medium; 4k and 128k): a Llama block whose files stack q/k/v into one `qkv_proj` and
gate/up into one `gate_up_proj` (llama.cpp: `attn_qkv`, and `ffn_up` twice as tall), with plain
rope or "longrope" (per-frequency short/long factors, which llama.cpp stores as the GGUF-only
tensors rope_factors_short/long, and an attention factor on cos/sin). Readers split the stacked
linears, so the decoder, the stage table and every method see Llama's block; writers stack them
again. llama.cpp's "phi3" keeps the Q/K rows unpermuted."""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from llmopt.model.families.base import Family, Fused
from llmopt.model.rope import attention_factor, longrope_original_context, rope_kind
from llmopt.model.validate import integer

if TYPE_CHECKING:
    from torch import nn

    from llmopt.model.arch import ArchSpec

QKV = Fused("self_attn.qkv_proj", "attn_qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"))
GATE_UP = Fused("mlp.gate_up_proj", "ffn_up", ("mlp.gate_proj", "mlp.up_proj"))


def _config_keys(arch: ArchSpec) -> dict[str, Any]:
    """Phi3Config keeps the pre-extension context at the top level (longrope's factor is
    max_position_embeddings / original_max_position_embeddings), not inside rope_scaling."""
    scaling = arch.rope_scaling or {}
    original = scaling.get("original_max_position_embeddings", arch.max_position_embeddings)
    return {"attention_bias": False, "original_max_position_embeddings": original,
            "sliding_window": arch.sliding_window, "partial_rotary_factor": 1.0}


def _gguf_keys(arch: ArchSpec) -> dict[str, Any]:
    """What llama.cpp's converter (Phi3MiniModel) writes for every Phi-3 beyond the shared keys: the
    sliding window (0 for none) and the original context (longrope writes it with its factors)."""
    keys: dict[str, Any] = {"attention.sliding_window": int(arch.sliding_window or 0)}
    if rope_kind(arch) != "longrope":
        keys["rope.scaling.original_context_length"] = longrope_original_context(arch)
    return keys


def _adapt_gguf(arch: ArchSpec, meta: dict[str, Any]) -> ArchSpec:
    """The sliding window back from the key `_gguf_keys` writes (0 or absent: none)."""
    window = meta.get(f"{arch.family.gguf_arch}.attention.sliding_window")
    if not window:
        return arch
    return replace(arch, sliding_window=integer(window, f"GGUF metadata {arch.family.gguf_arch}.attention.sliding_window"))


def _block(arch: ArchSpec, layer: int) -> nn.Module:
    """Llama's block; under longrope with an attention factor, one that scales cos/sin by it first."""
    from llmopt.model.decoder import DecoderBlock  # here, not at the top: the decoder imports torch

    factor = attention_factor(arch)
    if factor == 1.0:
        return DecoderBlock(arch, layer)
    return _scaled_rope_block()(arch, layer, factor)


@functools.cache
def _scaled_rope_block() -> type:
    """The block class for longrope's attention factor, made on first use (torch loads lazily)."""
    from llmopt.model.decoder import DecoderBlock

    class ScaledRopeBlock(DecoderBlock):
        """transformers multiplies longrope's cos/sin by `attention_factor` (llama.cpp: attn_factor)."""

        def __init__(self, arch: ArchSpec, layer: int, factor: float):
            super().__init__(arch, layer)
            self.rope_factor = factor

        def forward(self, x, cos, sin, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN201 - DecoderBlock's
            return super().forward(x, cos * self.rope_factor, sin * self.rope_factor, *args, **kwargs)

    return ScaledRopeBlock


PHI3 = Family(
    name="phi3",
    hf_architectures=("Phi3ForCausalLM",),
    hf_model_type="phi3",
    gguf_arch="phi3",
    permute_qk=False,
    fused=(QKV, GATE_UP),
    hf_config_keys=_config_keys,
    make_block=_block,
    gguf_keys=_gguf_keys,
    adapt_gguf=_adapt_gguf,
)
