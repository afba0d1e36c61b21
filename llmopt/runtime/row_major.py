"""CPU decode layout: keep each linear's weight as W^T ([in, out], contiguous) and compute x @ W^T.

For one token a linear is a matrix-vector product that only streams the weights from memory.
On CPU BLAS the x @ W^T form (accumulating rows of W^T into the output) streams them about 1.5-2x
faster than F.linear's x · W^T with W [out, in] (measured on SmolLM2's shapes; see
benchmarks/runtime.py). Same weights, same dtype; only the memory layout differs.

Very wide outputs (the LM head: 49,152 columns for SmolLM2) lose that advantage on one thread,
because the output row being accumulated no longer stays in the first-level cache. Those are
stored as `chunks` slabs of W^T side by side ([chunks, in, width], width <= CHUNK_WIDTH) and
multiplied as one batched product. With tied embeddings the LM head's weight also serves the
embedding lookup, so nothing is stored twice.

Linears that read the same input are fused: q/k/v into one product and gate/up into another.
Fewer, larger matrix-vector products stream the same bytes with less per-call cost: SmolLM2's 210
per-layer products took 23.1 ms a token, the 120 fused ones 18.5 ms (2 threads, same weights).
"""

from __future__ import annotations

import torch
from torch import nn

from llmopt.model.decoder import Decoder

CHUNK_WIDTH = 6144  # output columns per slab of a wide linear (measured best for the LM head on CPU)


def slab_count(out_features: int, width: int = CHUNK_WIDTH) -> int:
    """How many slabs a linear with `out_features` outputs is split into (1: not split)."""
    if out_features <= width:
        return 1
    fewest = -(-out_features // width)
    for k in range(fewest, 2 * fewest + 1):  # prefer an exact split: no padded columns
        if out_features % k == 0:
            return k
    return fewest


class RowMajorLinear(nn.Module):
    def __init__(self, linear: nn.Linear, width: int = CHUNK_WIDTH):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        k = slab_count(self.out_features, width)
        w_t = linear.weight.detach().t()
        self.slab_width = -(-self.out_features // k)
        if k * self.slab_width != self.out_features:  # pad the last slab with zero columns
            w_t = torch.cat([w_t, w_t.new_zeros(self.in_features, k * self.slab_width - self.out_features)], dim=1)
        # [k, in, width]: slab j holds output columns j*width .. (j+1)*width-1
        self.weight_t = nn.Parameter(w_t.reshape(self.in_features, k, self.slab_width).transpose(0, 1).contiguous(),
                                     requires_grad=False)
        self.bias = linear.bias

    @classmethod
    def stacked(cls, linears: list[nn.Linear], width: int = CHUNK_WIDTH) -> RowMajorLinear:
        """One linear computing all of `linears` (same input) side by side in its output."""
        bias = None
        if any(lin.bias is not None for lin in linears):
            bias = torch.cat([lin.bias.detach() if lin.bias is not None else lin.weight.new_zeros(lin.out_features)
                              for lin in linears])
        fused = nn.Linear(linears[0].in_features, sum(lin.out_features for lin in linears), bias=bias is not None,
                          device="meta")
        fused.weight = nn.Parameter(torch.cat([lin.weight.detach() for lin in linears]), requires_grad=False)
        if bias is not None:
            fused.bias = nn.Parameter(bias, requires_grad=False)
        return cls(fused, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_t.shape[0] == 1:
            y = x @ self.weight_t[0]
        else:  # [n, in] @ [k, in, w] -> [k, n, w] -> [n, k*w]
            flat = x.reshape(-1, self.in_features)
            y = torch.matmul(flat, self.weight_t).transpose(0, 1).reshape(flat.shape[0], -1)
            y = y[:, : self.out_features].reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def column(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` of the original W [out, in] (for a tied embedding lookup)."""
        return self.weight_t[index // self.slab_width, :, index % self.slab_width]


class TiedEmbedding(nn.Module):
    """The embedding lookup read from the LM head's stored weight (rows of W are its columns)."""

    def __init__(self, head: RowMajorLinear):
        super().__init__()
        self.head = head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head.column(ids)


def use_row_major_linears(model: Decoder, width: int = CHUNK_WIDTH) -> Decoder:
    """Swap every float nn.Linear of `model` for a RowMajorLinear (in place), sharing tied weights,
    with q/k/v and gate/up fused where all of them are float linears."""
    tied = model.lm_head.weight is model.embed_tokens.weight or (
        model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr())
    for block in model.layers:
        attn, mlp = block.self_attn, getattr(block, "mlp", None)  # a MoE block has experts instead (each swapped
        # below), under its own name or, in Qwen2-MoE, as "mlp": only a dense MLP has a fused gate/up
        if all(isinstance(m, nn.Linear) for m in (attn.q_proj, attn.k_proj, attn.v_proj)):
            attn.qkv = RowMajorLinear.stacked([attn.q_proj, attn.k_proj, attn.v_proj], width)
            del attn.q_proj, attn.k_proj, attn.v_proj
        if hasattr(mlp, "gate_up") and all(isinstance(m, nn.Linear) for m in (mlp.gate_proj, mlp.up_proj)):
            mlp.gate_up = RowMajorLinear.stacked([mlp.gate_proj, mlp.up_proj], width)
            del mlp.gate_proj, mlp.up_proj
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, RowMajorLinear(module, width))
    if tied:
        model.embed_tokens = TiedEmbedding(model.lm_head)
    return model
