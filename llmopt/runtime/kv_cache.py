"""A preallocated key/value cache: one buffer per layer, written in place, rolled back by length.

Sizing it once from the prompt and `--max-tokens` means decoding never reallocates or copies the
history, and speculative decoding discards rejected tokens by moving `length` back (`truncate`):
the stale entries beyond it are simply overwritten by the next write.
"""

from __future__ import annotations

import torch

from llmopt.errors import InputError
from llmopt.model.arch import ArchSpec


class StaticKVCache:
    """K/V of shape [layers, batch, kv_heads, max_len, head_dim]; implements decoder.KVCache."""

    def __init__(self, arch: ArchSpec, max_len: int, batch: int = 1, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        shape = (arch.num_layers, batch, arch.num_kv_heads, max_len, arch.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.last_layer = arch.num_layers - 1
        self.length = 0  # positions 0..length-1 hold valid entries

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        end = start + k.shape[2]
        if end > self.max_len:
            raise InputError(f"sequence of {end} tokens does not fit the KV cache ({self.max_len}); raise --max-tokens' budget or shorten the prompt")
        if start > self.length:
            raise ValueError(f"cache write at {start} leaves a gap after {self.length} valid positions")
        self.k[layer, :, :, start:end] = k
        self.v[layer, :, :, start:end] = v
        if layer == self.last_layer:
            self.length = end
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def truncate(self, length: int) -> None:
        """Forget everything from position `length` on (rejected draft tokens)."""
        self.length = min(self.length, length)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes
