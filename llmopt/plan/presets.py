"""Built-in architectures of public models, so `recommend` works offline and without downloads.

Each preset restates the public config.json of one hub repository (cited per entry). Only the fields
that size a model or its KV cache matter here; the rest are kept so `ArchSpec` stays complete.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from llmopt.errors import InputError
from llmopt.model.arch import ArchSpec
from llmopt.model.families import Family
from llmopt.model.families.gemma3 import GEMMA3
from llmopt.model.families.llama import LLAMA
from llmopt.model.families.mistral import MISTRAL
from llmopt.model.families.mixtral import MIXTRAL
from llmopt.model.families.phi3 import PHI3
from llmopt.model.families.qwen2 import QWEN2

# Llama 3.1's rope scaling (same block in the 8B, 70B and 405B configs).
_LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class Preset:
    name: str
    source: str  # the hub repository whose config.json this restates
    arch: ArchSpec

    @property
    def num_experts(self) -> int:
        return int(self.arch.extra.get("num_experts", 0))


def _arch(family: Family, hf_arch: str, *, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int,
          vocab: int, context: int, rope_theta: float, eps: float, tie: bool = False, head_dim: int | None = None,
          rope_scaling: dict | None = None, experts: int = 0, experts_per_token: int = 0) -> ArchSpec:
    extra: dict = {"hf_architecture": hf_arch}
    if experts:
        extra.update(num_experts=experts, experts_per_token=experts_per_token)
    return ArchSpec(
        family=family, hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim or hidden // heads, intermediate_size=ffn, vocab_size=vocab,
        max_position_embeddings=context, rope_theta=rope_theta, rms_norm_eps=eps, tie_word_embeddings=tie,
        attention_bias=family.qkv_bias, rope_scaling=rope_scaling, extra=extra,
    )


def _llama(**kw) -> ArchSpec:
    return _arch(LLAMA, "LlamaForCausalLM", **kw)


def _qwen2(**kw) -> ArchSpec:
    return _arch(QWEN2, "Qwen2ForCausalLM", **kw)


def _gemma3(*, window: int, local_base: float, query_scalar: int, **kw) -> ArchSpec:
    """Gemma 3's keys beyond the shared ones: the sliding window, the sliding layers' rope base and
    query_pre_attn_scalar (layers alternate five sliding, one global: the default layer_types)."""
    arch = _arch(GEMMA3, "Gemma3ForCausalLM", **kw)
    extra = {**arch.extra, "rope_local_base_freq": local_base, "query_pre_attn_scalar": query_scalar}
    return replace(arch, sliding_window=window, extra=extra)


_PRESETS = (
    # meta-llama/Llama-2-7b-hf config.json
    Preset("llama-2-7b", "meta-llama/Llama-2-7b-hf", _llama(
        hidden=4096, layers=32, heads=32, kv_heads=32, ffn=11008, vocab=32000, context=4096,
        rope_theta=10000.0, eps=1e-5)),
    # meta-llama/Llama-2-13b-hf config.json
    Preset("llama-2-13b", "meta-llama/Llama-2-13b-hf", _llama(
        hidden=5120, layers=40, heads=40, kv_heads=40, ffn=13824, vocab=32000, context=4096,
        rope_theta=10000.0, eps=1e-5)),
    # meta-llama/Llama-2-70b-hf config.json
    Preset("llama-2-70b", "meta-llama/Llama-2-70b-hf", _llama(
        hidden=8192, layers=80, heads=64, kv_heads=8, ffn=28672, vocab=32000, context=4096,
        rope_theta=10000.0, eps=1e-5)),
    # meta-llama/Meta-Llama-3-8B config.json
    Preset("llama-3-8b", "meta-llama/Meta-Llama-3-8B", _llama(
        hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, vocab=128256, context=8192,
        rope_theta=500000.0, eps=1e-5)),
    # meta-llama/Meta-Llama-3-70B config.json
    Preset("llama-3-70b", "meta-llama/Meta-Llama-3-70B", _llama(
        hidden=8192, layers=80, heads=64, kv_heads=8, ffn=28672, vocab=128256, context=8192,
        rope_theta=500000.0, eps=1e-5)),
    # meta-llama/Llama-3.1-8B config.json
    Preset("llama-3.1-8b", "meta-llama/Llama-3.1-8B", _llama(
        hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, vocab=128256, context=131072,
        rope_theta=500000.0, eps=1e-5, rope_scaling=_LLAMA31_ROPE)),
    # meta-llama/Llama-3.1-70B config.json
    Preset("llama-3.1-70b", "meta-llama/Llama-3.1-70B", _llama(
        hidden=8192, layers=80, heads=64, kv_heads=8, ffn=28672, vocab=128256, context=131072,
        rope_theta=500000.0, eps=1e-5, rope_scaling=_LLAMA31_ROPE)),
    # meta-llama/Llama-3.1-405B config.json
    Preset("llama-3.1-405b", "meta-llama/Llama-3.1-405B", _llama(
        hidden=16384, layers=126, heads=128, kv_heads=8, ffn=53248, vocab=128256, context=131072,
        rope_theta=500000.0, eps=1e-5, rope_scaling=_LLAMA31_ROPE)),
    # mistralai/Mistral-7B-v0.3 config.json (no sliding window, 32768-token vocabulary)
    Preset("mistral-7b", "mistralai/Mistral-7B-v0.3", _arch(
        MISTRAL, "MistralForCausalLM", hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, vocab=32768,
        context=32768, rope_theta=1000000.0, eps=1e-5)),
    # mistralai/Mixtral-8x7B-v0.1 config.json (num_local_experts 8, num_experts_per_tok 2);
    # llama.cpp stores it as the "llama" architecture with merged expert tensors.
    Preset("mixtral-8x7b", "mistralai/Mixtral-8x7B-v0.1", _arch(
        MIXTRAL, "MixtralForCausalLM", hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, vocab=32000,
        context=32768, rope_theta=1000000.0, eps=1e-5, experts=8, experts_per_token=2)),
    # google/gemma-3-1b-it config.json (head_dim 256 of its own; 512-token window on 5 of every 6 layers)
    Preset("gemma-3-1b", "google/gemma-3-1b-it", _gemma3(
        hidden=1152, layers=26, heads=4, kv_heads=1, head_dim=256, ffn=6912, vocab=262144, context=32768,
        rope_theta=1000000.0, eps=1e-6, tie=True, window=512, local_base=10000.0, query_scalar=256)),
    # microsoft/Phi-3-mini-4k-instruct config.json (no GQA; q/k/v and gate/up stored fused)
    Preset("phi-3-mini", "microsoft/Phi-3-mini-4k-instruct", _arch(
        PHI3, "Phi3ForCausalLM", hidden=3072, layers=32, heads=32, kv_heads=32, ffn=8192, vocab=32064,
        context=4096, rope_theta=10000.0, eps=1e-5)),
    # Qwen/Qwen2.5-0.5B config.json
    Preset("qwen2.5-0.5b", "Qwen/Qwen2.5-0.5B", _qwen2(
        hidden=896, layers=24, heads=14, kv_heads=2, ffn=4864, vocab=151936, context=32768,
        rope_theta=1000000.0, eps=1e-6, tie=True)),
    # Qwen/Qwen2.5-7B config.json
    Preset("qwen2.5-7b", "Qwen/Qwen2.5-7B", _qwen2(
        hidden=3584, layers=28, heads=28, kv_heads=4, ffn=18944, vocab=152064, context=131072,
        rope_theta=1000000.0, eps=1e-6)),
    # Qwen/Qwen2.5-14B config.json
    Preset("qwen2.5-14b", "Qwen/Qwen2.5-14B", _qwen2(
        hidden=5120, layers=48, heads=40, kv_heads=8, ffn=13824, vocab=152064, context=131072,
        rope_theta=1000000.0, eps=1e-5)),
    # Qwen/Qwen2.5-32B config.json
    Preset("qwen2.5-32b", "Qwen/Qwen2.5-32B", _qwen2(
        hidden=5120, layers=64, heads=40, kv_heads=8, ffn=27648, vocab=152064, context=131072,
        rope_theta=1000000.0, eps=1e-5)),
    # Qwen/Qwen2.5-72B config.json
    Preset("qwen2.5-72b", "Qwen/Qwen2.5-72B", _qwen2(
        hidden=8192, layers=80, heads=64, kv_heads=8, ffn=29568, vocab=152064, context=131072,
        rope_theta=1000000.0, eps=1e-5)),
    # Qwen/Qwen1.5-MoE-A2.7B config.json (60 experts of width 1408, 4 per token, not renormalised; a shared
    # expert of width 5632 on every token); read as its config.json is, so the family's keys land in `extra`
    Preset("qwen1.5-moe-a2.7b", "Qwen/Qwen1.5-MoE-A2.7B", ArchSpec.from_hf_config({
        "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_size": 2048, "intermediate_size": 5632,
        "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 151936,
        "max_position_embeddings": 8192, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "use_sliding_window": False, "sliding_window": 32768, "decoder_sparse_step": 1, "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632, "num_experts_per_tok": 4, "num_experts": 60, "norm_topk_prob": False})),
    # HuggingFaceTB/SmolLM2-135M config.json
    Preset("smollm2-135m", "HuggingFaceTB/SmolLM2-135M", _llama(
        hidden=576, layers=30, heads=9, kv_heads=3, ffn=1536, vocab=49152, context=8192,
        rope_theta=100000.0, eps=1e-5, tie=True)),
    # HuggingFaceTB/SmolLM2-360M config.json
    Preset("smollm2-360m", "HuggingFaceTB/SmolLM2-360M", _llama(
        hidden=960, layers=32, heads=15, kv_heads=5, ffn=2560, vocab=49152, context=8192,
        rope_theta=100000.0, eps=1e-5, tie=True)),
    # HuggingFaceTB/SmolLM2-1.7B config.json
    Preset("smollm2-1.7b", "HuggingFaceTB/SmolLM2-1.7B", _llama(
        hidden=2048, layers=24, heads=32, kv_heads=32, ffn=8192, vocab=49152, context=8192,
        rope_theta=130000.0, eps=1e-5, tie=True)),
)

PRESETS: dict[str, Preset] = {p.name: p for p in _PRESETS}


def preset_names() -> str:
    return ", ".join(PRESETS)


def find_preset(name: str) -> Preset | None:
    """The preset called `name` (case-insensitive; "_" and " " read as "-"), or None."""
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    return PRESETS.get(key)


def get_preset(name: str) -> Preset:
    preset = find_preset(name)
    if preset is None:
        raise InputError(f"unknown model preset {name!r}; presets: {preset_names()}")
    return preset
