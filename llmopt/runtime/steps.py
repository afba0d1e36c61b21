"""A model's forward steps over one cache: chunked prefill, then one decode step at a time.

Generation (runtime/generate.py, batch 1, sampled) and the benchmark's lockstep loop (api/bench/llmopt_engine.py,
B sequences, greedy) step the model the same way: prompt chunks of `prefill_chunk` tokens, each with the rope
of one forward over the whole prompt, then each step one token per sequence, through the eager model or
`generate --compile`'s fixed-shape step (one sequence). What they do with the logits is their own.
"""

from __future__ import annotations

import torch

from llmopt.model.decoder import Decoder
from llmopt.model.kv_cache import GenerationCache
from llmopt.runtime.compiled import CompiledDecoder


class Steps:
    """`prefill` and `decode` for `model`; `compiled` (CompiledDecoder.for_model) runs the decode steps when set,
    over the cache it provides (its own: the caller gets the cache from it, as a cache factory)."""

    def __init__(self, model: Decoder, prefill_chunk: int = 512, compiled: CompiledDecoder | None = None):
        self.model, self.prefill_chunk, self.compiled = model, prefill_chunk, compiled
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype

    def prefill(self, ids: torch.Tensor, cache: GenerationCache, reach: int = 0) -> torch.Tensor:
        """Write the K/V of `ids` [B, n] (positions 0..) into the cache in chunks, each with the rope of one
        forward over them all (longrope's table is chosen by where that forward ends: at least `reach`);
        return the last chunk's hidden states [B, chunk, hidden]."""
        h = None
        end = max(reach, ids.shape[1])
        for start in range(0, ids.shape[1], self.prefill_chunk):
            chunk = ids[:, start:start + self.prefill_chunk]
            rope = self.model.rotary(start, chunk.shape[1], self.dtype, reach=end)
            h = self.model.hidden(chunk, start, cache, rope)
        return h

    def decode(self, tokens: torch.Tensor | int, pos: int, cache: GenerationCache) -> torch.Tensor:
        """Logits [B, vocab] after `tokens` [B] (or one sequence's token id) at position `pos`, their K/V
        written into the cache."""
        if self.compiled is not None:
            return self.compiled.decode(tokens if isinstance(tokens, int) else int(tokens[0]), pos)[None]
        ids = torch.tensor([[tokens]], device=self.device) if isinstance(tokens, int) else tokens[:, None]
        return self.model(ids, pos, cache)[:, -1]
