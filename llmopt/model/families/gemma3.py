"""Gemma 3 (text; Gemma3ForCausalLM, e.g. google/gemma-3-1b-it): Llama's linears with Gemma's
conventions around them.

- RMSNorm scales by (1 + w); HF files store w, GGUF files 1 + w (llama.cpp's converter adds 1 to
  every "norm.weight"): `norm_shift`.
- Four norms per block: after attention and after the MLP too ("sandwich"); the MLP reads
  `pre_feedforward_layernorm`. q and k get a per-head norm before rope.
- GeGLU (tanh GELU), the embedding scaled by sqrt(hidden_size), head_dim independent of hidden.
- Layers alternate: five sliding-window layers (rope base `rope_local_base_freq`, 1e4) then one
  global layer (base `rope_theta`, 1e6, where the config's linear rope scaling applies), from the
  config's `layer_types`. Scores are scaled by query_pre_attn_scalar^-1/2.

GGUF ("gemma3") stores the sliding window; llama.cpp fixes the rest (set_swa_pattern(6), local base
10000, attention scale 1/sqrt(head_dim) except for its 62-layer 27B: 1/sqrt(hidden / heads); see
llama-model.cpp's LLM_ARCH_GEMMA3 hparams), so reading a GGUF rebuilds them the same way.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from llmopt.errors import InputError
from llmopt.model.families.base import Family, Stage
from llmopt.model.validate import integer, number

if TYPE_CHECKING:
    from torch import nn

    from llmopt.model.arch import ArchSpec

SLIDING, FULL = "sliding_attention", "full_attention"
PATTERN = 6  # every 6th layer global: transformers' default sliding_window_pattern, llama.cpp's set_swa_pattern(6)
LOCAL_BASE = 10000.0  # transformers' default rope_local_base_freq; llama.cpp's rope_freq_base_train_swa
GLOBAL_TABLE, LOCAL_TABLE = 0, 1  # the order of `_rope_archs`' tables
# Gemma3TextConfig's defaults (transformers), which fill what a config.json leaves out: the published
# gemma-3-4b-it and larger name only hidden/intermediate sizes, layers, rope scaling and window in
# their nested text_config (and 12b/27b the head counts). The rope bases, query_pre_attn_scalar and
# tying take their defaults in `_adapt_hf`.
TEXT_DEFAULTS = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6, "sliding_window": 4096, "attention_bias": False,
}  # fmt: skip

STAGES = (
    Stage(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "input_layernorm", "self_attn"),
    Stage(("self_attn.o_proj",), "self_attn.v_proj", "self_attn.o_proj"),
    Stage(("mlp.gate_proj", "mlp.up_proj"), "pre_feedforward_layernorm", "mlp"),
    Stage(("mlp.down_proj",), "mlp.up_proj", "mlp.down_proj"),
)
# HF -> llama.cpp names of the norms beyond Llama's input norm (gguf's MODEL_TENSORS[GEMMA3])
NORMS = (("post_attention_layernorm.weight", "post_attention_norm.weight"),
         ("pre_feedforward_layernorm.weight", "ffn_norm.weight"),
         ("post_feedforward_layernorm.weight", "post_ffw_norm.weight"))  # fmt: skip


def default_layer_types(layers: int, pattern: int = PATTERN) -> list[str]:
    return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(layers)]


def layer_types(arch: ArchSpec) -> list[str]:
    return arch.extra.get("layer_types") or default_layer_types(arch.num_layers)


def local_base(arch: ArchSpec) -> float:
    return float(arch.extra.get("rope_local_base_freq", LOCAL_BASE))


def query_scalar(arch: ArchSpec) -> int | float:
    """What the scores are divided by the square root of (an int in Gemma's configs)."""
    return arch.extra.get("query_pre_attn_scalar", arch.head_dim)


def _adapt_hf(arch: ArchSpec, cfg: dict[str, Any]) -> ArchSpec:
    """Gemma3TextConfig's keys: `layer_types` (or `sliding_window_pattern`), the local rope base and
    query_pre_attn_scalar; transformers 5 nests the two rope setups in `rope_parameters`."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            raise InputError(f"config.json: `{key}` is not supported for gemma3 (Gemma 3 has none)")
    if cfg.get("use_bidirectional_attention"):
        raise InputError("config.json: `use_bidirectional_attention` (EmbeddingGemma) is not supported")
    rope = cfg.get("rope_parameters") or {}
    full, local = rope.get(FULL) or {}, rope.get(SLIDING) or {}
    theta = full.get("rope_theta", cfg.get("rope_theta", 1_000_000.0))
    scaling = arch.rope_scaling
    if full.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in full.items() if k != "rope_theta"}
    if local.get("rope_type", "default") != "default":
        raise InputError("config.json: rope scaling on gemma3's sliding layers is not supported")
    types = cfg.get("layer_types") or default_layer_types(arch.num_layers, int(cfg.get("sliding_window_pattern", PATTERN)))
    if len(types) != arch.num_layers or any(t not in (SLIDING, FULL) for t in types):
        raise InputError(f"config.json: `layer_types` must list {arch.num_layers} of {SLIDING!r} / {FULL!r}")
    if arch.sliding_window is None:
        raise InputError("config.json: gemma3 needs `sliding_window`")
    extra = {**arch.extra, "layer_types": list(types),
             "rope_local_base_freq": float(local.get("rope_theta", cfg.get("rope_local_base_freq", LOCAL_BASE))),
             "query_pre_attn_scalar": cfg.get("query_pre_attn_scalar", 256)}
    tied = bool(cfg.get("tie_word_embeddings", True))  # Gemma3TextConfig's default; gemma-3-1b's config omits it
    return replace(arch, rope_theta=float(theta), rope_scaling=scaling, tie_word_embeddings=tied, extra=extra)


def _adapt_gguf(arch: ArchSpec, meta: dict[str, Any]) -> ArchSpec:
    """What llama.cpp assumes for "gemma3" (its hparams loader), and the keys it reads when present."""
    g = arch.family.gguf_arch
    window = meta.get(f"{g}.attention.sliding_window")
    if window is None:
        raise InputError(f"GGUF metadata is missing {g}.attention.sliding_window")
    pattern = meta.get(f"{g}.attention.sliding_window_pattern")
    if isinstance(pattern, list) and len(pattern) == arch.num_layers:
        types = [SLIDING if bool(p) else FULL for p in pattern]
    else:
        types = default_layer_types(arch.num_layers, integer(pattern, f"GGUF metadata {g}.attention.sliding_window_pattern")
                                    if pattern is not None else PATTERN)  # fmt: skip
    base = number(meta.get(f"{g}.rope.freq_base_swa", LOCAL_BASE), f"GGUF metadata {g}.rope.freq_base_swa", open_lo=True)
    scalar = arch.hidden_size // arch.num_heads if arch.num_layers == 62 else arch.head_dim
    extra = {**arch.extra, "layer_types": types, "rope_local_base_freq": float(base), "query_pre_attn_scalar": scalar}
    return replace(arch, sliding_window=integer(window, f"GGUF metadata {g}.attention.sliding_window"), extra=extra)


def _gguf_keys(arch: ArchSpec) -> dict[str, Any]:
    """The sliding window, as the converter writes it; the local base and the layer pattern only
    where they differ from what llama.cpp assumes (newer llama.cpp reads those keys)."""
    keys: dict[str, Any] = {"attention.sliding_window": int(arch.sliding_window or 0)}
    if local_base(arch) != LOCAL_BASE:
        keys["rope.freq_base_swa"] = local_base(arch)
    if layer_types(arch) != default_layer_types(arch.num_layers):
        keys["attention.sliding_window_pattern"] = [t == SLIDING for t in layer_types(arch)]
    return keys


def _config_keys(arch: ArchSpec) -> dict[str, Any]:
    """Gemma3TextConfig's own keys (rope_theta / rope_local_base_freq / rope_scaling in the form
    transformers 4 wrote and transformers 5 still reads)."""
    return {"hidden_activation": "gelu_pytorch_tanh", "hidden_act": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": query_scalar(arch), "sliding_window": arch.sliding_window,
            "layer_types": layer_types(arch), "rope_local_base_freq": local_base(arch),
            "attention_bias": arch.attention_bias, "attn_logit_softcapping": None, "final_logit_softcapping": None}


def _kv_windows(arch: ArchSpec) -> list[int | None]:
    """A sliding layer never reads keys older than its window; a global layer reads them all."""
    return [arch.sliding_window if t == SLIDING else None for t in layer_types(arch)]


def _rope_archs(arch: ArchSpec) -> tuple[ArchSpec, ...]:
    """The global layers' table (rope_theta, with the config's scaling) and the sliding layers' own."""
    return arch, replace(arch, rope_theta=local_base(arch), rope_scaling=None)


def _block(arch: ArchSpec, layer: int) -> nn.Module:
    return _block_class()(arch, layer)


@functools.cache
def _block_class() -> type:
    """The block class, made on first use (torch loads lazily)."""
    from llmopt.model.decoder import DecoderBlock, RMSNorm

    class Gemma3Block(DecoderBlock):
        """Sandwich norms around attention and the MLP; this layer's rope table and window."""

        def __init__(self, arch: ArchSpec, layer: int):
            super().__init__(arch, layer)
            self.pre_feedforward_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, arch.family.norm_shift)
            self.post_feedforward_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, arch.family.norm_shift)
            sliding = layer_types(arch)[layer] == SLIDING
            self.self_attn.window = arch.sliding_window if sliding else None
            self.table = LOCAL_TABLE if sliding else GLOBAL_TABLE
            self.head_dim = arch.head_dim
            # attention divides scores by sqrt(head_dim); Gemma by sqrt(query_pre_attn_scalar)
            factor = (arch.head_dim / query_scalar(arch)) ** 0.5
            if factor != 1.0:
                self.self_attn.q_norm.register_forward_hook(lambda _m, _a, out: out * factor)

        def forward(self, x, cos, sin, start=0, cache=None):  # noqa: ANN001, ANN201 - DecoderBlock's
            cols = slice(self.table * self.head_dim, (self.table + 1) * self.head_dim)
            cos, sin = cos[..., cols], sin[..., cols]
            x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, start, cache))
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))

    return Gemma3Block


GEMMA3 = Family(
    name="gemma3",
    hf_architectures=("Gemma3ForCausalLM",),
    hf_model_type="gemma3_text",
    hf_multimodal=("Gemma3ForConditionalGeneration",),  # 4B and larger: the language model is read, not the vision tower
    hf_defaults=TEXT_DEFAULTS,
    gguf_arch="gemma3",
    permute_qk=False,
    qk_norm=True,
    stages=STAGES,
    norm_shift=1.0,
    scale_embedding=True,
    activation="gelu_pytorch_tanh",
    extra_norms=NORMS,
    hf_config_keys=_config_keys,
    make_block=_block,
    adapt_hf=_adapt_hf,
    adapt_gguf=_adapt_gguf,
    gguf_keys=_gguf_keys,
    rope_archs=_rope_archs,
    kv_windows=_kv_windows,
)
