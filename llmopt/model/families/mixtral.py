"""Mixtral (MixtralForCausalLM, e.g. mistralai/Mixtral-8x7B-v0.1): Mistral's attention with a sparse
mixture-of-experts MLP. A router (`block_sparse_moe.gate`) scores E experts per token; the top k
(softmax, then the k weights renormalised to sum to 1) each run a SwiGLU MLP (w1 gate, w3 up, w2 down)
and their outputs are summed with those weights.

HF files hold each expert's linears separately; llama.cpp's converter stores the model as its "llama"
architecture with `llama.expert_count` / `llama.expert_used_count`, the router as `ffn_gate_inp`
and each kind of expert linear stacked over the experts in expert order (`ffn_gate_exps` from w1,
`ffn_up_exps` from w3, `ffn_down_exps` from w2; conversion/llama.py, gguf-py's tensor_mapping.py).
llama.cpp's llama graph routes with softmax gating and renormalised weights, as transformers does.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from llmopt.model.families.base import LLAMA_STAGES, Experts, Family, experts_per_token, num_experts
from llmopt.model.validate import integer

if TYPE_CHECKING:
    from torch import nn

    from llmopt.model.arch import ArchSpec

EXPERTS = Experts(router="block_sparse_moe.gate", module="block_sparse_moe.experts", gate="w1", up="w3", down="w2")
# MixtralConfig's defaults when a config.json leaves them out (Mixtral-8x7B's values)
DEFAULT_EXPERTS, DEFAULT_PER_TOKEN = 8, 2


def _with_experts(arch: ArchSpec, count: Any, used: Any, where: str) -> ArchSpec:
    n = integer(count, f"{where} expert count", hi=1 << 16)
    k = integer(used, f"{where} experts per token", hi=n)
    return replace(arch, family=with_expert_stages(arch.family, n), extra={**arch.extra, "num_experts": n, "experts_per_token": k})


@functools.cache
def with_expert_stages(family: Family, count: int) -> Family:
    """The family with its stage table for `count` experts: attention's stages, then each expert's
    (GPTQ quantizes each expert from the tokens routed to it)."""
    assert family.experts is not None
    return replace(family, stages=LLAMA_STAGES[:2] + family.experts.stages(count))


def _adapt_hf(arch: ArchSpec, cfg: dict[str, Any]) -> ArchSpec:
    return _with_experts(arch, cfg.get("num_local_experts", DEFAULT_EXPERTS), cfg.get("num_experts_per_tok", DEFAULT_PER_TOKEN),
                         "config.json `num_local_experts` / `num_experts_per_tok`:")


def _adapt_gguf(arch: ArchSpec, meta: dict[str, Any]) -> ArchSpec:
    return _with_experts(arch, meta.get("llama.expert_count"), meta.get("llama.expert_used_count"),
                         "GGUF metadata llama.expert_count / llama.expert_used_count:")


def _config_keys(arch: ArchSpec) -> dict[str, Any]:
    return {"num_local_experts": num_experts(arch), "num_experts_per_tok": experts_per_token(arch),
            "sliding_window": arch.sliding_window, "output_router_logits": False}


def _gguf_keys(arch: ArchSpec) -> dict[str, Any]:
    return {"expert_count": num_experts(arch), "expert_used_count": experts_per_token(arch)}


def _block(arch: ArchSpec, layer: int) -> nn.Module:
    from llmopt.model.moe import MoEBlock  # here, not at the top: the block imports torch

    return MoEBlock(arch, layer)


MIXTRAL = Family(
    name="mixtral",
    hf_architectures=("MixtralForCausalLM",),
    hf_model_type="mixtral",
    gguf_arch="llama",
    permute_qk=True,
    stages=LLAMA_STAGES[:2],  # the experts' stages join once the count is read (`with_expert_stages`)
    hf_config_keys=_config_keys,
    make_block=_block,
    adapt_hf=_adapt_hf,
    adapt_gguf=_adapt_gguf,
    gguf_keys=_gguf_keys,
    experts=EXPERTS,
)
