"""A preallocated key/value cache: one buffer per layer, written in place, rolled back by length.

Sizing it once from the prompt and `--max-tokens` means decoding never reallocates or copies the
history, and speculative decoding discards rejected tokens by moving `length` back (`truncate`):
the stale entries beyond it are simply overwritten by the next write.

It lives beside the decoder because everything that generates uses it: the runtime, and
calibration when the model writes its own text. It is a module so that a compiled decode step
owns its buffers (CUDA graphs need them at fixed addresses, written in place).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from llmopt.errors import OptionError
from llmopt.model.arch import ArchSpec
from llmopt.model.decoder import KVCache, Position


class GenerationCache(KVCache, Protocol):
    """A cache generation can roll back: `length` valid positions, `truncate` to forget the rest."""

    length: int

    def truncate(self, length: int) -> None: ...


class CacheFactory(Protocol):
    """How the runtime gets a cache for one generation: `factory(arch, max_len, batch, dtype, device)`."""

    def __call__(self, arch: ArchSpec, max_len: int, batch: int, dtype: torch.dtype,
                 device: torch.device | str) -> GenerationCache: ...


class StaticKVCache(nn.Module):
    """One K and one V buffer per layer, each [batch, kv_heads, max_len, head_dim]; implements
    decoder.KVCache. Per layer, not one [layers, ...] tensor: a compiled step writes each layer's
    buffer in place, where inductor turned each write into a view of one shared buffer into a
    kernel of 0.3-2.3 ms per step (`generate --compile` on CPU, docs/generate.md)."""

    def __init__(self, arch: ArchSpec, max_len: int, batch: int = 1, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        super().__init__()
        shape = (batch, arch.num_kv_heads, max_len, arch.head_dim)
        for layer in range(arch.num_layers):
            self.register_buffer(f"k{layer}", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
            self.register_buffer(f"v{layer}", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.max_len = max_len
        self.last_layer = arch.num_layers - 1
        self.length = 0  # positions 0..length-1 hold valid entries

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s whole K and V buffers (every position, written or not)."""
        return getattr(self, f"k{layer}"), getattr(self, f"v{layer}")

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: Position) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.layer(layer)
        if isinstance(start, torch.Tensor):  # a fixed-shape step: write in place, attend over the whole buffer
            index = start + torch.arange(k.shape[2], device=start.device)
            keys.index_copy_(2, index, k)
            values.index_copy_(2, index, v)
            return keys, values
        end = start + k.shape[2]
        if end > self.max_len:
            raise OptionError(f"sequence of {end} tokens does not fit the KV cache ({self.max_len}); raise <max_tokens>' budget or shorten the prompt")
        if start > self.length:
            raise ValueError(f"cache write at {start} leaves a gap after {self.length} valid positions")
        keys[:, :, start:end] = k
        values[:, :, start:end] = v
        if layer == self.last_layer:
            self.length = end
        return keys[:, :, :end], values[:, :, :end]

    def truncate(self, length: int) -> None:
        """Forget everything from position `length` on (rejected draft tokens)."""
        self.length = min(self.length, length)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers())
