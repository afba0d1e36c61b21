"""A normalized description of a decoder's architecture, read from an HF config or GGUF metadata."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from llmopt.errors import InputError
from llmopt.model.families import Family, family_for_gguf, family_for_hf
from llmopt.model.multimodal import text_config
from llmopt.model.validate import MAX_DIM, MAX_LAYERS, check_heads, integer, number


@dataclass(frozen=True)
class ArchSpec:
    family: Family
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool
    rope_scaling: dict[str, Any] | None = None
    sliding_window: int | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)  # e.g. the original HF class name

    @property
    def hf_architecture(self) -> str:
        return self.extra.get("hf_architecture", self.family.hf_architectures[0])

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["family"] = self.family.name
        d["hf_architecture"] = self.hf_architecture
        d.pop("extra")
        return d

    # ---------------------------------------------------------------- HF config.json
    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ArchSpec:
        if not isinstance(cfg, dict):
            raise InputError(f"config.json: expected a JSON object, got {type(cfg).__name__}")
        archs = cfg.get("architectures")
        if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
            raise InputError(f"config.json: `architectures` must be a list of class names, got {archs!r:.60}")
        model_type = cfg.get("model_type")
        family = family_for_hf(archs, model_type if isinstance(model_type, str) else None)
        extra: dict[str, Any] = {"hf_architecture": (archs or [family.hf_architectures[0]])[0]}
        nested = text_config(cfg, family)
        if nested is not None:  # a multimodal checkpoint: its language model, as a text model of the family
            cfg, extra["multimodal"] = nested
            extra["hf_architecture"] = family.hf_architectures[0]
        cfg = {**family.hf_defaults, **cfg}  # what transformers' config class assumes for omitted keys

        def get(key: str, default: Any = None) -> Any:
            value = cfg.get(key, default)
            if value is None:
                raise InputError(f"config.json: missing `{key}`")
            return value

        rope = cfg.get("rope_parameters") or {}
        if not isinstance(rope, dict):
            raise InputError(f"config.json: `rope_parameters` must be an object, got {type(rope).__name__}")
        rope_scaling = cfg.get("rope_scaling")
        if rope_scaling is not None and not isinstance(rope_scaling, dict):
            raise InputError(f"config.json: `rope_scaling` must be an object, got {type(rope_scaling).__name__}")
        if rope_scaling is None and rope.get("rope_type", "default") != "default":
            rope_scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor")}
        partial = cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
        if partial != 1.0:
            raise InputError(f"config.json: partial rotary embeddings (partial_rotary_factor {partial!r:.20}) are not supported")
        if rope_scaling is not None and "original_max_position_embeddings" in cfg:  # Phi-3 keeps it at the top level
            rope_scaling = {"original_max_position_embeddings": cfg["original_max_position_embeddings"], **rope_scaling}
        hidden = integer(get("hidden_size"), "config.json `hidden_size`")
        heads = integer(get("num_attention_heads"), "config.json `num_attention_heads`")
        kv_heads = integer(cfg.get("num_key_value_heads") or heads, "config.json `num_key_value_heads`")
        check_heads(heads, kv_heads, "config.json")
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        return family.adapt_hf(cls(
            family=family,
            hidden_size=hidden,
            num_layers=integer(get("num_hidden_layers"), "config.json `num_hidden_layers`", hi=MAX_LAYERS),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=integer(cfg.get("head_dim") or hidden // heads, "config.json `head_dim`"),
            intermediate_size=integer(get("intermediate_size"), "config.json `intermediate_size`"),
            vocab_size=integer(get("vocab_size"), "config.json `vocab_size`"),
            max_position_embeddings=integer(cfg.get("max_position_embeddings", 2048), "config.json `max_position_embeddings`"),
            rope_theta=number(cfg.get("rope_theta", rope.get("rope_theta", 10000.0)), "config.json `rope_theta`", open_lo=True),
            rms_norm_eps=number(cfg.get("rms_norm_eps", 1e-6), "config.json `rms_norm_eps`", hi=1.0),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", family.qkv_bias)),
            rope_scaling=rope_scaling,
            sliding_window=None if window is None else integer(window, "config.json `sliding_window`"),
            extra=extra,
        ), cfg)

    def to_hf_config(self, dtype: str) -> dict[str, Any]:
        """A config.json that transformers, vLLM and llmopt read back to this same spec."""
        cfg: dict[str, Any] = {
            "architectures": [self.hf_architecture],
            "model_type": self.family.hf_model_type,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "torch_dtype": dtype,
        }
        cfg.update(self.family.hf_config_keys(self))
        if self.rope_scaling:
            cfg["rope_scaling"] = dict(self.rope_scaling)
        return cfg

    # ---------------------------------------------------------------- GGUF metadata
    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], tensor_names: set[str]) -> ArchSpec:
        arch = meta.get("general.architecture")
        if not isinstance(arch, str):
            raise InputError("GGUF file has no general.architecture")
        family = family_for_gguf(arch, experts=bool(meta.get(f"{arch}.expert_count")))

        def key(name: str, default: Any = None) -> Any:
            value = meta.get(f"{arch}.{name}", default)
            if value is None:
                raise InputError(f"GGUF metadata is missing {arch}.{name}")
            return value

        def count(name: str, default: Any = None, hi: int = MAX_DIM) -> int:
            return integer(key(name, default), f"GGUF metadata {arch}.{name}", hi=hi)

        hidden = count("embedding_length")
        heads = count("attention.head_count")
        kv_heads = count("attention.head_count_kv", heads)
        check_heads(heads, kv_heads, "GGUF metadata")
        head_dim = meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count") or hidden // heads
        head_dim = integer(head_dim, f"GGUF metadata {arch}.attention.key_length")
        tokens = meta.get("tokenizer.ggml.tokens")
        vocab = meta.get(f"{arch}.vocab_size", len(tokens) if isinstance(tokens, list) else None)
        if vocab is None:
            raise InputError(f"GGUF metadata has neither {arch}.vocab_size nor a token list")
        rope_scaling = None
        if meta.get(f"{arch}.rope.scaling.type") in ("linear", "yarn"):
            rope_scaling = {
                "rope_type": meta[f"{arch}.rope.scaling.type"],
                "factor": number(meta.get(f"{arch}.rope.scaling.factor", 1.0), f"GGUF metadata {arch}.rope.scaling.factor", open_lo=True),
            }
            if f"{arch}.rope.scaling.original_context_length" in meta:
                rope_scaling["original_max_position_embeddings"] = count("rope.scaling.original_context_length")
        return family.adapt_gguf(cls(
            family=family,
            hidden_size=hidden,
            num_layers=count("block_count", hi=MAX_LAYERS),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=count("feed_forward_length"),
            vocab_size=integer(vocab, f"GGUF metadata {arch}.vocab_size"),
            max_position_embeddings=count("context_length", 2048),
            rope_theta=_f32(number(meta.get(f"{arch}.rope.freq_base", 10000.0), f"GGUF metadata {arch}.rope.freq_base", open_lo=True)),
            rms_norm_eps=_f32(number(key("attention.layer_norm_rms_epsilon"), f"GGUF metadata {arch}.attention.layer_norm_rms_epsilon", hi=1.0)),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            rope_scaling=rope_scaling,
        ), meta)


def _f32(value: Any) -> float:
    """A float32 from GGUF as the shortest decimal that round-trips (1e-05, not 9.99999974e-06)."""
    import numpy as np  # here, not at the top: only GGUF metadata needs it, and `recommend` starts without numpy

    return float(str(np.float32(value)))
