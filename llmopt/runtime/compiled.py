"""A decode step with fixed shapes, so torch.compile can fuse it (and, on CUDA, replay it as a graph).

gpt-fast's recipe: the position is a tensor, this step's K/V are written into the preallocated
cache in place, and attention runs over the whole cache with a mask that hides the positions not
yet written. Every step then has the same shapes and reads the same tensors, so one compiled graph
serves all of them. On CUDA, mode "reduce-overhead" records it as a CUDA graph, which removes the
per-kernel launch cost that dominates batch-1 decode; on CPU, inductor fuses the small element-wise
ops between the matrix products. The eager `Decoder` stays the reference: tests check that both
give the same tokens.
"""

from __future__ import annotations

import torch
from torch import nn

from llmopt.model.decoder import Decoder, grouped_attention, rotate_half
from llmopt.runtime.kv_cache import StaticKVCache


class StaticDecodeStep(nn.Module):
    """`step(token, pos) -> logits` for one token at position `pos` (both [1] int64 tensors)."""

    def __init__(self, model: Decoder, cache: StaticKVCache):
        super().__init__()
        self.model = model
        self.cache = cache
        arch = model.arch
        self.window = arch.sliding_window
        device = cache.k.device
        # buffers, not plain attributes: CUDA graphs treat them as fixed addresses written in place
        self.register_buffer("k", cache.k, persistent=False)
        self.register_buffer("v", cache.v, persistent=False)
        self.register_buffer("positions", torch.arange(cache.max_len, device=device), persistent=False)
        cos, sin = model.rotary(0, cache.max_len, cache.k.dtype)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, token: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        m = self.model
        x = m.embed_tokens(token.view(1, 1))
        cos, sin = self.cos.index_select(0, pos), self.sin.index_select(0, pos)  # [1, head_dim]
        mask = self.positions <= pos
        if self.window is not None:
            mask = mask & (self.positions > pos - self.window)
        for i, block in enumerate(m.layers):
            attn = block.self_attn
            h = block.input_layernorm(x)
            q, k, v = attn.project(h)
            q = q.reshape(1, 1, attn.n_heads, attn.head_dim).transpose(1, 2)
            k = k.reshape(1, 1, attn.n_kv, attn.head_dim).transpose(1, 2)
            v = v.reshape(1, 1, attn.n_kv, attn.head_dim).transpose(1, 2)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            self.k[i].index_copy_(2, pos, k)
            self.v[i].index_copy_(2, pos, v)
            o = grouped_attention(q, self.k[i], self.v[i], mask.view(1, -1))
            x = x + attn.o_proj(o.transpose(1, 2).reshape(1, 1, -1))
            x = x + block.mlp(block.post_attention_layernorm(x))
        return m.lm_head(m.norm(x))[0, -1]


class CompiledDecoder:
    """Keeps one static cache and its compiled step, reused by every generation that fits in it.

    Compiling takes a while (tens of seconds), so the cache is sized generously once (`max_len`,
    rounded up) and only a longer request builds a new one.
    """

    ROUND = 256

    def __init__(self, model: Decoder, mode: str | None = None):
        self.model = model
        self.mode = mode
        self.cache: StaticKVCache | None = None
        self.step = None

    def cache_for(self, max_len: int) -> StaticKVCache:
        if self.cache is None or self.cache.max_len < max_len:
            param = next(self.model.parameters())
            size = -(-max_len // self.ROUND) * self.ROUND
            self.cache = StaticKVCache(self.model.arch, size, 1, param.dtype, param.device)
            module = StaticDecodeStep(self.model, self.cache)
            self.step = torch.compile(module, mode=self.mode, fullgraph=True, dynamic=False)
        self.cache.length = 0
        return self.cache

    def __call__(self, token: int, pos: int) -> torch.Tensor:
        assert self.step is not None and self.cache is not None
        device = self.cache.k.device
        logits = self.step(torch.tensor([token], device=device), torch.tensor([pos], device=device))
        self.cache.length = pos + 1
        return logits.clone()  # CUDA graphs reuse their output buffer on the next replay
