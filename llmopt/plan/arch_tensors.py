"""Every tensor an architecture implies, with its HF and llama.cpp names and its shape.

Presets and config-only models have no tensor files, yet exact sizes need every tensor: the GGUF
mix rules depend on each tensor's name, layer and row length. The list is fully determined by
`ArchSpec`: the family lists each block's tensors (`Family.tensor_shapes`) and `model.rope` the
GGUF-only ones; tests check it against the tensors of real files.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TypeVar

from llmopt.model.arch import ArchSpec
from llmopt.model.families.base import BIAS, EMBEDDING, EXPERT, LINEAR, NORM, OUTPUT, ROPE, ROUTER, experts_per_token, num_experts
from llmopt.model.rope import gguf_only_tensors

__all__ = ["BIAS", "EMBEDDING", "EXPERT", "LINEAR", "NORM", "OUTPUT", "ROPE", "ROUTER", "PlannedTensor", "PlannedTensors",
           "arch_tensors"]  # fmt: skip

T = TypeVar("T")


@dataclass(frozen=True)
class PlannedTensor:
    hf_name: str | None  # None for GGUF-only tensors (llama3 rope factors)
    gguf_name: str
    shape: tuple[int, ...]  # HF orientation ([out, in] for linears; [experts, out, in] for experts)
    role: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def linears(self) -> int:
        return linear_count(self.role, self.shape)


class PlannedTensors(list[PlannedTensor]):
    """A model's tensors. Sizing each candidate format reads the same per-model sums (parameters,
    directory bytes, llama.cpp's tensor classes), so `once` computes each of them a single time;
    the list is never changed after it is built."""

    def once(self, compute: Callable[..., T], *args: Hashable) -> T:
        """compute(self, *args), remembered for this list."""
        memo = self.__dict__.setdefault("_memo", {})
        if (compute, args) not in memo:
            memo[compute, args] = compute(self, *args)
        return memo[compute, args]


def linear_count(role: str, shape: tuple[int, ...]) -> int:
    """How many separate [out, in] matrices a tensor holds (experts are stored merged in GGUF)."""
    return shape[0] if role == EXPERT else 1


def arch_tensors(arch: ArchSpec) -> PlannedTensors:
    """All tensors of a model of this architecture, in checkpoint order (embeddings, blocks, head)."""
    h = arch.hidden_size
    tensors = [PlannedTensor("model.embed_tokens.weight", "token_embd.weight", (arch.vocab_size, h), EMBEDDING)]
    tensors += [PlannedTensor(None, name, shape, ROPE) for name, shape in gguf_only_tensors(arch).items()]
    for i in range(arch.num_layers):
        tensors += [PlannedTensor(*t) for t in arch.family.tensor_shapes(arch, i)]
    tensors.append(PlannedTensor("model.norm.weight", "output_norm.weight", (h,), NORM))
    if not arch.tie_word_embeddings:
        tensors.append(PlannedTensor("lm_head.weight", "output.weight", (arch.vocab_size, h), OUTPUT))
    return PlannedTensors(tensors)


def parameter_count(tensors: PlannedTensors) -> int:
    """Parameters as HF counts them (GGUF-only rope factors excluded)."""
    return tensors.once(_parameter_count)


def _parameter_count(tensors: PlannedTensors) -> int:
    return sum(t.numel for t in tensors if t.hf_name is not None)


def active_parameter_count(arch: ArchSpec, tensors: list[PlannedTensor]) -> int:
    """Parameters used per token: all but the experts a token is not routed to."""
    e, k = num_experts(arch), experts_per_token(arch)
    total = 0
    for t in tensors:
        if t.hf_name is None:
            continue
        total += t.numel * k // e if t.role == EXPERT else t.numel
    return total
