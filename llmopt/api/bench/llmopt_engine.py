"""llmopt's runtime as a benchmark engine: B prompts of one length, decoded greedily in lockstep.

The batch shares one `StaticKVCache`, [B, kv_heads, P + gen, head_dim] per layer (the cache
already has a batch axis), and one `Decoder` forward per step, so each step streams the weights
once for all B sequences: batch B buys up to B tokens for the bytes batch 1 reads for one. Prefill
and the decode steps are generation's own (runtime/steps.py), over the B prompts together. Greedy, EOS
ignored: every sequence gets exactly `gen` tokens, the same tokens batch 1 gives each prompt (tested).
"""

from __future__ import annotations

import time

import torch
from torch import nn

from llmopt.api.bench.prompts import special_token_ids
from llmopt.api.bench.trace import Trace, peak_rss_bytes, reset_peak_rss
from llmopt.model.kv_cache import StaticKVCache
from llmopt.plan.kv_cache import kv_bytes_per_token
from llmopt.runtime.compiled import CompiledDecoder
from llmopt.runtime.generate import _sync
from llmopt.runtime.steps import Steps
from llmopt.runtime.weights import LoadedModel


class LlmoptEngine:
    name = "llmopt"

    def __init__(self, loaded: LoadedModel, prefill_chunk: int = 512, compile: bool = False):
        self.loaded = loaded
        self.model = loaded.model
        # `generate --compile`'s fixed-shape step (one sequence), compiled when a run first builds its cache
        self.compiled = CompiledDecoder.for_model(self.model) if compile else None
        self.steps = Steps(self.model, prefill_chunk, self.compiled)  # generation's own prefill and decode steps
        arch = self.model.arch
        self.vocab_size = arch.vocab_size
        self.context = arch.max_position_embeddings
        self.weight_bytes = decode_weight_bytes(self.model)
        # plan's count is for f16 caches (2 bytes an element); this cache holds the runtime dtype
        self.kv_bytes_per_token = kv_bytes_per_token(arch, "f16") * loaded.dtype.itemsize // 2
        self.device = str(loaded.device)
        self.arch = arch

    def excluded_ids(self) -> set[int]:
        return special_token_ids(self.loaded.tokenizer)

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], gen: int) -> Trace:
        device, model = self.loaded.device, self.model
        batch, length = len(prompts), len(prompts[0])
        if self.compiled is not None:  # (built and compiled here, before the clock starts)
            cache = self.compiled(model.arch, length + gen, batch, self.loaded.dtype, device)
        else:
            cache = StaticKVCache(model.arch, length + gen, batch, self.loaded.dtype, device)
        ids = torch.tensor(prompts, dtype=torch.long, device=device)
        _reset_peak(device)
        _sync(device)
        t0 = time.perf_counter()
        token = model.lm_head(self.steps.prefill(ids, cache)[:, -1]).argmax(-1)  # [B]
        tokens = [token.tolist()]  # the host reads each step's tokens, as a server streaming them would
        ttft = time.perf_counter() - t0
        steps = []
        for i in range(1, gen):
            t = time.perf_counter()
            token = self.steps.decode(token, length + i - 1, cache).argmax(-1)
            tokens.append(token.tolist())
            steps.append(time.perf_counter() - t)
        per_sequence = [list(seq) for seq in zip(*tokens)]
        return Trace(per_sequence, ttft, steps, _peak(device))


def decode_weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights one decode step reads: every parameter and buffer (not rope's) stored once, less an
    untied embedding table (a step looks up B of its rows; a tied one is read whole as the LM head)."""
    seen: dict[int, int] = {}
    buffers = [b for name, b in model.named_buffers() if not name.startswith("rotary.")]  # packed int4 weights
    for t in [*model.parameters(), *buffers]:  # (a oneDNN-reordered weight has no data pointer: keyed by identity)
        seen.setdefault(id(t) if t.is_mkldnn else t.data_ptr(), t.numel() * t.element_size())
    total = sum(seen.values())
    embed = getattr(model.embed_tokens, "weight", None)
    if isinstance(embed, torch.Tensor) and embed.data_ptr() in seen:
        head = getattr(model.lm_head, "weight", None)
        if not (isinstance(head, torch.Tensor) and head.data_ptr() == embed.data_ptr()):
            total -= embed.nbytes
    return total


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        reset_peak_rss()


def _peak(device: torch.device) -> int | None:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return peak_rss_bytes()
