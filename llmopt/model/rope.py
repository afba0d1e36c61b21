"""Rotary position embeddings: the one place that reads a config's rope scaling.

The decoder needs the (scaled) inverse frequencies; GGUF files of llama3-scaled models also carry
llama.cpp's `rope_freqs` tensor (the per-frequency divisors), which the writer emits and the
planner counts. Both ask `rope_kind` which scaling a config uses, so they cannot disagree.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from llmopt.errors import InputError
from llmopt.model.arch import ArchSpec

if TYPE_CHECKING:
    import torch

KINDS = ("default", "linear", "llama3", "yarn")
ROPE_FREQS = "rope_freqs.weight"  # the GGUF-only tensor of llama3-scaled models


def rope_kind(arch: ArchSpec) -> str:
    """"default", "linear", "llama3" or "yarn", from `rope_type` (or the older `type`) of the scaling."""
    scaling = arch.rope_scaling or {}
    return scaling.get("rope_type") or scaling.get("type") or "default"


def gguf_only_tensors(arch: ArchSpec) -> dict[str, tuple[int, ...]]:
    """Tensors a GGUF of this architecture holds that no HF checkpoint does: name -> shape."""
    return {ROPE_FREQS: (arch.head_dim // 2,)} if rope_kind(arch) == "llama3" else {}


def inv_freq(arch: ArchSpec) -> torch.Tensor:
    """Rotary inverse frequencies, with llama3 / linear scaling applied when the config asks for it."""
    import torch  # here, not at the top: planning (recommend) reads this module without torch

    dim = arch.head_dim
    inv = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = arch.rope_scaling or {}
    kind = rope_kind(arch)
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
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
    raise InputError(f"unsupported rope scaling {kind!r}; supported: default, linear, llama3")


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
