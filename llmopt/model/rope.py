"""Rotary position embeddings: the one place that reads a config's rope scaling.

The decoder needs the (scaled) inverse frequencies; GGUF files of llama3-scaled models also carry
llama.cpp's `rope_freqs` tensor (the per-frequency divisors), and longrope models (Phi-3 128k) its
`rope_factors_long/short` tensors and an attention factor on cos/sin; the writer emits them, the
reader rebuilds the config's scaling from them and the planner counts them. All ask `rope_kind`
which scaling a config uses, so they cannot disagree.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from llmopt.errors import InputError
from llmopt.model.validate import integer, number

if TYPE_CHECKING:
    import torch

    from llmopt.model.arch import ArchSpec  # a type only: the families read this module, arch.py reads them

KINDS = ("default", "linear", "llama3", "yarn", "longrope")
ROPE_FREQS = "rope_freqs.weight"  # the GGUF-only tensor of llama3-scaled models
# longrope's per-frequency divisors, as llama.cpp's converter stores them (Phi-3 128k)
ROPE_FACTORS_LONG, ROPE_FACTORS_SHORT = "rope_factors_long.weight", "rope_factors_short.weight"
GGUF_ONLY = (ROPE_FREQS, ROPE_FACTORS_LONG, ROPE_FACTORS_SHORT)


def rope_kind(arch: ArchSpec) -> str:
    """"default", "linear", "llama3", "yarn" or "longrope", from `rope_type` (or the older `type`)
    of the scaling; Phi-3's first 128k configs call longrope "su"."""
    scaling = arch.rope_scaling or {}
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    return "longrope" if kind == "su" else kind


def gguf_only_tensors(arch: ArchSpec) -> dict[str, tuple[int, ...]]:
    """Tensors a GGUF of this architecture holds that no HF checkpoint does: name -> shape."""
    kind = rope_kind(arch)
    if kind == "llama3":
        return {ROPE_FREQS: (arch.head_dim // 2,)}
    if kind == "longrope":
        return {ROPE_FACTORS_LONG: (arch.head_dim // 2,), ROPE_FACTORS_SHORT: (arch.head_dim // 2,)}
    return {}


def gguf_only_values(arch: ArchSpec) -> dict[str, torch.Tensor]:
    """The values of `gguf_only_tensors` (float32), as llama.cpp's converter computes them."""
    import torch  # here, not at the top: planning (recommend) reads this module without torch

    kind = rope_kind(arch)
    if kind == "llama3":
        return {ROPE_FREQS: llama3_factors(arch)}
    if kind == "longrope":
        return {name: torch.tensor(values, dtype=torch.float32) for name, values in longrope_factors(arch).items()}
    return {}


def longrope_original_context(arch: ArchSpec) -> int:
    """The context the model was trained at before longrope extended it to max_position_embeddings."""
    return int((arch.rope_scaling or {}).get("original_max_position_embeddings") or arch.max_position_embeddings)


def attention_factor(arch: ArchSpec) -> float:
    """The factor longrope puts on cos and sin (transformers' `attention_factor`, llama.cpp's
    rope.scaling.attn_factor): sqrt(1 + ln(s) / ln(original context)) for an extension s > 1, else 1."""
    if rope_kind(arch) != "longrope":
        return 1.0
    scaling = arch.rope_scaling or {}
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = longrope_original_context(arch)
    s = scaling.get("factor") or arch.max_position_embeddings / original
    return math.sqrt(1 + math.log(s) / math.log(original)) if s > 1.0 else 1.0


def longrope_factors(arch: ArchSpec) -> dict[str, list[float]]:
    """GGUF name -> longrope's long and short factors (head_dim / 2 each), checked."""
    scaling = arch.rope_scaling or {}
    out = {}
    for name, key in ((ROPE_FACTORS_LONG, "long_factor"), (ROPE_FACTORS_SHORT, "short_factor")):
        values = scaling.get(key)
        if not isinstance(values, (list, tuple)) or len(values) != arch.head_dim // 2 \
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in values):  # fmt: skip
            raise InputError(f"longrope scaling needs `{key}`: {arch.head_dim // 2} positive numbers")
        out[name] = [float(v) for v in values]
    return out


def long_from(arch: ArchSpec) -> int | None:
    """Where longrope switches to its long factors: a forward whose last position is at or past the
    original context uses them for all its positions (transformers' `longrope_frequency_update`:
    max(position_ids) + 1 > original_max_position_embeddings). None for every other rope."""
    return longrope_original_context(arch) if rope_kind(arch) == "longrope" else None


def inv_freq(arch: ArchSpec, long: bool = False) -> torch.Tensor:
    """Rotary inverse frequencies, with llama3 / linear scaling applied when the config asks for it;
    under longrope the short factors, or the long ones with `long` (other ropes ignore it)."""
    import torch  # here, not at the top: planning (recommend) reads this module without torch

    dim = arch.head_dim
    inv = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = arch.rope_scaling or {}
    kind = rope_kind(arch)
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "longrope":  # transformers: the short factors up to the original context, then the long
        return inv / torch.tensor(longrope_factors(arch)[ROPE_FACTORS_LONG if long else ROPE_FACTORS_SHORT], dtype=torch.float32)
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)  # long wavelengths: slow down
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return torch.where(medium, blended, scaled)
    raise InputError(f"unsupported rope scaling {kind!r}; supported: default, linear, llama3, longrope")


def llama3_factors(arch: ArchSpec) -> torch.Tensor | None:
    """llama.cpp's `rope_freqs` for llama3-style scaling (convert_hf_to_gguf computes the same), else None."""
    import torch  # here, not at the top: planning (recommend) reads this module without torch

    if rope_kind(arch) != "llama3":
        return None
    scaling = arch.rope_scaling or {}
    factor = float(scaling.get("factor", 8.0))
    low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
    freqs = 1.0 / (arch.rope_theta ** (torch.arange(0, arch.head_dim, 2, dtype=torch.float32) / arch.head_dim))
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    factors = []
    for f in freqs.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)


def rope_scaling_from_gguf(arch: ArchSpec, meta: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any] | None:
    """longrope's `rope_scaling` from a GGUF (llama.cpp writes no scaling type for it: the factors are
    the tensors rope_factors_long/short, F32 arrays in `tensors`), else None."""
    have = [n for n in (ROPE_FACTORS_LONG, ROPE_FACTORS_SHORT) if n in tensors]
    if not have:
        return None
    half = arch.head_dim // 2
    if len(have) != 2 or any(tensors[n].size != half for n in have):
        raise InputError(f"longrope needs both {ROPE_FACTORS_LONG} and {ROPE_FACTORS_SHORT} as float tensors of {half} values")
    # str of a float32 is its shortest decimal (1.05, not 1.0499999523162842), as HF configs write them
    scaling: dict[str, Any] = {"rope_type": "longrope",
                               "long_factor": [float(str(v)) for v in tensors[ROPE_FACTORS_LONG].reshape(-1)],
                               "short_factor": [float(str(v)) for v in tensors[ROPE_FACTORS_SHORT].reshape(-1)]}
    g = arch.family.gguf_arch
    original = meta.get(f"{g}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = integer(original, f"GGUF metadata {g}.rope.scaling.original_context_length")
    stored = meta.get(f"{g}.rope.scaling.attn_factor")
    if stored is not None:  # kept only where it differs from what transformers derives from the contexts
        stored = number(stored, f"GGUF metadata {g}.rope.scaling.attn_factor", open_lo=True)
        if abs(stored - attention_factor(replace(arch, rope_scaling=scaling))) > 1e-6:
            scaling["attention_factor"] = float(str(stored))
    return scaling
