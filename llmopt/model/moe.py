"""The mixture-of-experts MLP and the block that holds it (a family with `Family.experts`).

Each token's router scores pick its top k experts (softmax over all experts, then, for Mixtral, the
k weights renormalised to sum to 1, as transformers and llama.cpp do); each expert is a gated MLP
run only on the tokens routed to it, and the outputs are summed with the routing weights. A shared
expert (Qwen2-MoE) runs on every token, scaled by a sigmoid gate, and is added last. Module names
follow the HF files (`block_sparse_moe.gate`, `block_sparse_moe.experts.3.w1`, `mlp.shared_expert`),
so weights load by name and the quantization pipeline's hooks see each expert's own tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from llmopt.model.decoder import ACTIVATIONS, DecoderBlock, KVCache, Position
from llmopt.model.families.base import Experts, expert_ffn, num_experts, shared_expert_ffn

if TYPE_CHECKING:  # a type only: arch.py reads the families, which build these blocks
    from llmopt.model.arch import ArchSpec


class Expert(nn.Module):
    """One expert: a gated MLP whose linears carry the family's names (Mixtral's w1, w3, w2)."""

    def __init__(self, arch: ArchSpec, spec: Experts, width: int):
        super().__init__()
        h, f = arch.hidden_size, width
        self.names = (spec.gate, spec.up, spec.down)
        for name, shape in zip(self.names, ((h, f), (h, f), (f, h))):
            setattr(self, name, nn.Linear(*shape, bias=False))
        self.act = ACTIVATIONS[arch.family.activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, n) for n in self.names)
        return down(self.act(gate(x)) * up(x))


class SparseMoE(nn.Module):
    """Router and experts; `forward` sends each token to its top-k experts."""

    def __init__(self, arch: ArchSpec, spec: Experts):
        super().__init__()
        prefix = spec.router.rpartition(".")[0] + "."
        self.router_name, self.experts_name = spec.router.removeprefix(prefix), spec.module.removeprefix(prefix)
        setattr(self, self.router_name, nn.Linear(arch.hidden_size, num_experts(arch), bias=False))
        setattr(self, self.experts_name, nn.ModuleList(Expert(arch, spec, expert_ffn(arch)) for _ in range(num_experts(arch))))
        self.shared_name = self.shared_gate_name = None
        if spec.shared:  # Qwen2-MoE: an expert every token runs, and its one-output gate
            self.shared_name, self.shared_gate_name = spec.shared.removeprefix(prefix), spec.shared_gate.removeprefix(prefix)  # type: ignore[union-attr]
            setattr(self, self.shared_name, Expert(arch, spec, shared_expert_ffn(arch)))
            setattr(self, self.shared_gate_name, nn.Linear(arch.hidden_size, 1, bias=False))
        self.top_k = int(arch.extra["experts_per_token"])
        self.renormalize = bool(arch.extra.get("renormalize", spec.renormalize))  # Qwen2-MoE's config says (norm_topk_prob)
        # run experts no token chose too (on no rows): a block loaded for calibration (`load_block`), so
        # every chunk's forward reaches every expert's stage of the stage table, in order
        self.every_expert = False

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's chosen experts [n, k] and their weights [n, k] (softmax in float32, as transformers)."""
        probs = getattr(self, self.router_name)(x).float().softmax(-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return chosen, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        chosen, weights = self.route(x)
        out = torch.zeros_like(x)
        experts = getattr(self, self.experts_name)
        if torch.compiler.is_compiling():  # the fixed-shape decode step: no data-dependent shapes, so every
            for e, expert in enumerate(experts):  # expert runs on every row, weighted 0 where not chosen
                out = out + expert(x) * (weights * (chosen == e)).sum(-1, keepdim=True)
        else:
            for e, expert in enumerate(experts):
                rows, slot = (chosen == e).nonzero(as_tuple=True)
                if rows.numel() or self.every_expert:  # an expert no token chose does not run
                    out.index_add_(0, rows, expert(x[rows]) * weights[rows, slot, None])
        if self.shared_name is not None:  # after the routed experts, as transformers adds it
            gate = torch.sigmoid(getattr(self, self.shared_gate_name)(x))
            out = out + gate * getattr(self, self.shared_name)(x)
        return out.reshape(shape)


class MoEBlock(DecoderBlock):
    """A decoder layer whose MLP is a `SparseMoE`, held under the family's module name."""

    def __init__(self, arch: ArchSpec, layer: int):
        super().__init__(arch, layer)
        del self.mlp
        spec = arch.family.experts
        assert spec is not None, arch.family.name
        self.moe_name = spec.router.rpartition(".")[0]
        setattr(self, self.moe_name, SparseMoE(arch, spec))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start: Position = 0,
                cache: KVCache | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, start, cache)
        return x + getattr(self, self.moe_name)(self.post_attention_layernorm(x))
