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

import time
import types
from collections.abc import Callable

import torch
from torch import nn

from llmopt.model.arch import ArchSpec
from llmopt.model.decoder import Decoder
from llmopt.model.kv_cache import StaticKVCache


MODULE_GUARDS_SKIPPED = torch.compiler.skip_guard_on_all_nn_modules_unsafe


def own_code(method: Callable) -> Callable:
    """A bound method re-made around its own copy of the code object. Dynamo keeps compiled graphs per
    code object, so every StaticDecodeStep's graphs are then its own: no module's step can pick up a
    graph traced from another module (which, with module guards skipped, nothing would catch)."""
    fn = method.__func__
    own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    return types.MethodType(own, method.__self__)


class StaticDecodeStep(nn.Module):
    """`step(token, pos) -> logits` for one token at position `pos` (both [1] int64 tensors).

    It runs the decoder's own blocks: given a tensor position, attention writes into the cache
    in place and attends over the whole buffer under a mask (`attention_mask`)."""

    def __init__(self, model: Decoder, cache: StaticKVCache):
        super().__init__()
        self.model = model
        self.cache = cache  # a submodule: its K/V buffers have fixed addresses
        cos, sin = model.rotary.stepwise(cache.max_len, cache.layer(0)[0].dtype)  # row p: a decode step at p
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, token: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self.after_embedding(self.model.embed(token.view(1, 1)), pos)

    def after_embedding(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The part that is compiled: the embedding lookup stays eager, since a GGUF embedding of a type
        without a field module dequantizes its rows with numpy (no graph), and it costs one op."""
        rope = self.cos.index_select(0, pos), self.sin.index_select(0, pos)  # [1, head_dim]
        h = self.model.hidden_of(x, pos, self.cache, rope)
        return self.model.lm_head(h)[0, -1]


class CompiledDecoder:
    """Keeps one static cache and its compiled step, reused by every generation that fits in it.

    Compiling takes a while (tens of seconds), so the cache is sized generously once (`max_len`,
    rounded up) and only a longer request builds a new one. It is the runtime's cache factory
    when decode steps are compiled.
    """

    ROUND = 256

    def __init__(self, model: Decoder, mode: str | None = None):
        self.model = model
        self.mode = mode
        self.cache: StaticKVCache | None = None
        self.module: StaticDecodeStep | None = None
        self.step = None
        self.built_s: float | None = None  # seconds the last call spent compiling (None: it reused the step)

    def __call__(self, arch: ArchSpec, max_len: int, batch: int, dtype: torch.dtype,
                 device: torch.device | str) -> StaticKVCache:
        """The compiled step's cache, emptied (a `CacheFactory`; batch 1, the model's dtype and device)."""
        if batch != 1:
            raise ValueError("the compiled decode step runs one sequence")
        self.built_s = None
        if self.cache is None or self.cache.max_len < max_len:
            t0 = time.perf_counter()
            param = next(self.model.parameters())
            size = -(-max_len // self.ROUND) * self.ROUND
            self.cache = StaticKVCache(self.model.arch, size, 1, param.dtype, param.device)
            self.module = StaticDecodeStep(self.model, self.cache)
            step = own_code(self.module.after_embedding)
            # on CPU, without dynamo's guards on the modules' attributes (485 tensors and ~5000 checks for
            # SmolLM2, 1.3 ms of a ~15 ms step): safe because this graph serves only this module (own_code),
            # whose tensors keep their shapes. CUDA's "reduce-overhead" mode takes no such option here.
            how = {"mode": self.mode} if self.mode else {"options": {"guard_filter_fn": MODULE_GUARDS_SKIPPED}}
            self.step = torch.compile(step, fullgraph=True, dynamic=False, **how)
            # compiled here, not in the first decode step, so generation's TTFT/TPOT time decoding only.
            # The step writes K/V at the last slot, which a real step writes before it ever reads it
            # (attention masks the slots after its position).
            self.decode(0, size - 1)
            if param.device.type == "cuda":
                torch.cuda.synchronize(param.device)
            self.built_s = time.perf_counter() - t0
        self.cache.length = 0
        return self.cache

    @classmethod
    def for_model(cls, model: Decoder) -> CompiledDecoder:
        """The step for `model`'s device: recorded as a CUDA graph on CUDA ("reduce-overhead"), fused by
        inductor's C++ backend on CPU."""
        return cls(model, "reduce-overhead" if next(model.parameters()).device.type == "cuda" else None)

    def decode(self, token: int, pos: int) -> torch.Tensor:
        """Logits after `token` at position `pos`, written into the cache."""
        assert self.step is not None and self.cache is not None
        device = self.cache.layer(0)[0].device
        x = self.model.embed(torch.tensor([[token]], device=device))
        logits = self.step(x, torch.tensor([pos], device=device))
        self.cache.length = pos + 1
        return logits.clone()  # CUDA graphs reuse their output buffer on the next replay
