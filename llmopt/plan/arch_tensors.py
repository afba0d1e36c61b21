"""Every tensor an architecture implies, with its HF and llama.cpp names and its shape.

Presets and config-only models have no tensor files, yet exact sizes need every tensor: the GGUF
mix rules depend on each tensor's name, layer and row length. For the supported families the list
is fully determined by `ArchSpec`; tests check it against the tensors of real files.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from llmopt.model.arch import ArchSpec

# Roles decide how a tensor is stored: linears are what GPTQ/AWQ quantize; experts are linears of
# which only some are read per token; the rest stay in float in every format.
LINEAR, EXPERT, EMBEDDING, OUTPUT, NORM, BIAS, ROUTER, ROPE = (
    "linear", "expert", "embedding", "output", "norm", "bias", "router", "rope")


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
        """How many separate [out, in] matrices this tensor holds (experts are stored merged in GGUF)."""
        return self.shape[0] if self.role == EXPERT else 1


def num_experts(arch: ArchSpec) -> int:
    return int(arch.extra.get("num_experts", 0))


def experts_per_token(arch: ArchSpec) -> int:
    return int(arch.extra.get("experts_per_token", 0))


def arch_tensors(arch: ArchSpec) -> list[PlannedTensor]:
    """All tensors of a model of this architecture, in checkpoint order (embeddings, blocks, head)."""
    fam = arch.family
    h, kv = arch.hidden_size, arch.num_kv_heads * arch.head_dim
    q = arch.num_heads * arch.head_dim
    tensors: list[PlannedTensor] = [PlannedTensor("model.embed_tokens.weight", "token_embd.weight",
                                                  (arch.vocab_size, h), EMBEDDING)]
    if (arch.rope_scaling or {}).get("rope_type") == "llama3":  # convert_hf_to_gguf stores the factors
        tensors.append(PlannedTensor(None, "rope_freqs.weight", (arch.head_dim // 2,), ROPE))
    for i in range(arch.num_layers):
        block: list[tuple[str, tuple[int, ...], str]] = [
            ("input_layernorm.weight", (h,), NORM),
            ("self_attn.q_proj.weight", (q, h), LINEAR),
            ("self_attn.k_proj.weight", (kv, h), LINEAR),
            ("self_attn.v_proj.weight", (kv, h), LINEAR),
        ]
        if arch.attention_bias:
            block += [("self_attn.q_proj.bias", (q,), BIAS), ("self_attn.k_proj.bias", (kv,), BIAS),
                      ("self_attn.v_proj.bias", (kv,), BIAS)]
        block += [("self_attn.o_proj.weight", (h, q), LINEAR), ("post_attention_layernorm.weight", (h,), NORM)]
        for suffix, shape, role in block:
            hf = f"model.layers.{i}.{suffix}"
            tensors.append(PlannedTensor(hf, fam.hf_to_gguf_name(hf) or hf, shape, role))
        tensors += _mlp(arch, i)
    tensors.append(PlannedTensor("model.norm.weight", "output_norm.weight", (h,), NORM))
    if not arch.tie_word_embeddings:
        tensors.append(PlannedTensor("lm_head.weight", "output.weight", (arch.vocab_size, h), OUTPUT))
    return tensors


def _mlp(arch: ArchSpec, i: int) -> list[PlannedTensor]:
    """The feed-forward of block i: a SwiGLU MLP, or (MoE) a router and merged experts."""
    h, f, e = arch.hidden_size, arch.intermediate_size, num_experts(arch)
    if not e:
        out = []
        for suffix, shape in (("mlp.gate_proj.weight", (f, h)), ("mlp.up_proj.weight", (f, h)),
                              ("mlp.down_proj.weight", (h, f))):
            hf = f"model.layers.{i}.{suffix}"
            out.append(PlannedTensor(hf, arch.family.hf_to_gguf_name(hf) or hf, shape, LINEAR))
        return out
    # Mixtral: block_sparse_moe.gate is the router; experts.{j}.w1/w3/w2 are gate/up/down, which
    # llama.cpp's converter stacks into one 3-D tensor per kind.
    moe = f"model.layers.{i}.block_sparse_moe"
    return [
        PlannedTensor(f"{moe}.gate.weight", f"blk.{i}.ffn_gate_inp.weight", (e, h), ROUTER),
        PlannedTensor(f"{moe}.experts.*.w1.weight", f"blk.{i}.ffn_gate_exps.weight", (e, f, h), EXPERT),
        PlannedTensor(f"{moe}.experts.*.w3.weight", f"blk.{i}.ffn_up_exps.weight", (e, f, h), EXPERT),
        PlannedTensor(f"{moe}.experts.*.w2.weight", f"blk.{i}.ffn_down_exps.weight", (e, h, f), EXPERT),
    ]


def parameter_count(tensors: list[PlannedTensor]) -> int:
    """Parameters as HF counts them (GGUF-only rope factors excluded)."""
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
