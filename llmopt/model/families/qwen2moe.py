"""Qwen2-MoE (Qwen2MoeForCausalLM, e.g. Qwen/Qwen1.5-MoE-A2.7B): Qwen2's attention (q/k/v biases, rows
unpermuted in GGUF) with a sparse MLP. A router (`mlp.gate`) picks each token's top k of E experts
(softmax in float32; the k weights renormalised only when `norm_topk_prob`, false in the published
configs), each a SwiGLU of width `moe_intermediate_size`; a shared expert (`mlp.shared_expert`, width
`shared_expert_intermediate_size`) runs on every token, scaled by sigmoid(`mlp.shared_expert_gate`(x)),
a linear with one output, and is added to the routed experts' sum (transformers' Qwen2MoeSparseMoeBlock).

llama.cpp's converter writes the "qwen2moe" architecture: `expert_count`, `expert_used_count`,
`expert_feed_forward_length`, `expert_shared_feed_forward_length`; the router `ffn_gate_inp`, the
experts stacked as `ffn_{gate,up,down}_exps`, the shared expert as `ffn_{gate,up,down}_shexp` and its
gate `ffn_gate_inp_shexp` (F32; conversion/qwen.py, gguf-py's tensor_mapping.py). llama.cpp's graph
never renormalises the routed weights and runs every layer as MoE (models/qwen2moe.cpp), so a config
with `norm_topk_prob` true is not written as GGUF, and dense layers (`mlp_only_layers`,
`decoder_sparse_step` > 1) are refused.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from llmopt.errors import InputError
from llmopt.model.families.base import LLAMA_STAGES, Experts, Family, expert_ffn, experts_per_token, num_experts, shared_expert_ffn
from llmopt.model.families.mixtral import _block, _with_experts
from llmopt.model.validate import integer

if TYPE_CHECKING:
    from llmopt.model.arch import ArchSpec

EXPERTS = Experts(router="mlp.gate", module="mlp.experts", gate="gate_proj", up="up_proj", down="down_proj",
                  renormalize=False, shared="mlp.shared_expert", shared_gate="mlp.shared_expert_gate")  # fmt: skip
# Qwen2MoeConfig's defaults when a config.json leaves them out (Qwen1.5-MoE-A2.7B's values)
DEFAULTS = {"num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
            "shared_expert_intermediate_size": 5632, "norm_topk_prob": False, "decoder_sparse_step": 1}  # fmt: skip


def _widths(arch: ArchSpec, expert: Any, shared: Any, renormalize: bool, where: str) -> ArchSpec:
    extra = {"expert_ffn": integer(expert, f"{where} expert feed-forward length"),
             "shared_expert_ffn": integer(shared, f"{where} shared expert feed-forward length"), "renormalize": renormalize}
    return replace(arch, extra={**arch.extra, **extra})


def _adapt_hf(arch: ArchSpec, cfg: dict[str, Any]) -> ArchSpec:
    cfg = {**DEFAULTS, **{k: v for k, v in cfg.items() if v is not None}}
    step = integer(cfg["decoder_sparse_step"], "config.json `decoder_sparse_step`")
    dense = cfg.get("mlp_only_layers") or []
    if not isinstance(dense, list):
        raise InputError(f"config.json: `mlp_only_layers` must be a list of layer numbers, got {dense!r:.40}")
    dense = [i for i in range(arch.num_layers) if i in dense or (i + 1) % step != 0]
    if dense:
        raise InputError(f"config.json: dense layers in a Qwen2-MoE (layers {dense[:4]}{' ...' if len(dense) > 4 else ''}, "
                         "from `mlp_only_layers` / `decoder_sparse_step`) are not supported")  # fmt: skip
    arch = _with_experts(replace(arch, attention_bias=bool(cfg.get("qkv_bias", arch.attention_bias))), cfg["num_experts"],
                         cfg["num_experts_per_tok"], "config.json `num_experts` / `num_experts_per_tok`:")  # fmt: skip
    return _widths(arch, cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"], bool(cfg["norm_topk_prob"]),
                   "config.json `moe_intermediate_size` / `shared_expert_intermediate_size`:")  # fmt: skip


def _adapt_gguf(arch: ArchSpec, meta: dict[str, Any]) -> ArchSpec:
    used = meta.get("qwen2moe.expert_used_count")
    arch = _with_experts(arch, meta.get("qwen2moe.expert_count"), used,
                         "GGUF metadata qwen2moe.expert_count / qwen2moe.expert_used_count:")  # fmt: skip
    # what llama.cpp's loader assumes when a width is missing: n_ff / n_expert_used, and n_ff
    expert = meta.get("qwen2moe.expert_feed_forward_length", arch.intermediate_size // experts_per_token(arch))
    shared = meta.get("qwen2moe.expert_shared_feed_forward_length", arch.intermediate_size)
    return _widths(arch, expert, shared, False, "GGUF metadata qwen2moe.expert_feed_forward_length / "
                   "qwen2moe.expert_shared_feed_forward_length:")  # fmt: skip


def _config_keys(arch: ArchSpec) -> dict[str, Any]:
    return {"num_experts": num_experts(arch), "num_experts_per_tok": experts_per_token(arch),
            "moe_intermediate_size": expert_ffn(arch), "shared_expert_intermediate_size": shared_expert_ffn(arch),
            "norm_topk_prob": bool(arch.extra.get("renormalize", False)), "decoder_sparse_step": 1, "mlp_only_layers": [],
            "qkv_bias": arch.attention_bias, "use_sliding_window": False, "output_router_logits": False}  # fmt: skip


def _gguf_keys(arch: ArchSpec) -> dict[str, Any]:
    if arch.extra.get("renormalize"):
        raise InputError("a Qwen2-MoE with `norm_topk_prob` true cannot be written as GGUF: llama.cpp's qwen2moe "
                         "never renormalises the routed experts' weights")  # fmt: skip
    return {"expert_count": num_experts(arch), "expert_used_count": experts_per_token(arch),
            "expert_feed_forward_length": expert_ffn(arch), "expert_shared_feed_forward_length": shared_expert_ffn(arch)}


QWEN2MOE = Family(
    name="qwen2moe",
    hf_architectures=("Qwen2MoeForCausalLM",),
    hf_model_type="qwen2_moe",
    gguf_arch="qwen2moe",
    permute_qk=False,
    qkv_bias=True,
    stages=LLAMA_STAGES[:2],  # the experts' and the shared expert's stages join once the count is read
    hf_config_keys=_config_keys,
    make_block=_block,
    adapt_hf=_adapt_hf,
    adapt_gguf=_adapt_gguf,
    gguf_keys=_gguf_keys,
    experts=EXPERTS,
)
