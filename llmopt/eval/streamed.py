"""Perplexity, KL and top-1 of models that do not fit in memory: run one block at a time.

A model is read from its `ModelSource` (an HF directory, a GGUF file of any type, a GPTQ or AWQ
checkpoint: each tensor dequantized as it is read) and run block by block over all windows at
once: the hidden states [windows, ctx, hidden] in the eval dtype stay between blocks, one block's
weights are resident (`load_block`, as the quantization pipeline and the imatrix run a model).
After the last block and the final norm, the LM head turns one window at a time into log-probs;
the head is held whole in the eval dtype when the caller's budget allows, else read from the file
in row slabs for each window (`ModelSource.load_rows`). A reference's final hidden states are
computed once and scored against every model (`Stream.log_probs`). The sums are
`perplexity.score`'s, the same as the loaded path's.

Memory: one block, windows x ctx x hidden x (dtype bytes) per model whose hidden states are held
(the model and its reference), the embedding table while the windows are embedded, one window's
[ctx-1, V] logits per model, and the head where it is kept whole.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmopt.calibration.capture import embed
from llmopt.eval.perplexity import head_log_probs
from llmopt.model.decoder import RMSNorm, Rotary, load_block
from llmopt.model.source import ModelSource

SLAB_BYTES = 1 << 28  # a head read in slabs: at most this much of it at once


@torch.inference_mode()
def final_hidden(source: ModelSource, windows: torch.Tensor, dtype: torch.dtype, device: torch.device | str = "cpu",
                 batch: int = 1, on_layer: Callable[[int, int], None] | None = None) -> torch.Tensor:  # fmt: skip
    """The final-norm hidden states of `windows` [n, ctx]: [n, ctx, hidden] in `dtype` on `device`,
    the blocks loaded one at a time and each run over `batch` windows per forward; `on_layer(done, total)`."""
    arch = source.arch
    x = embed(source, windows, dtype, device)
    cos, sin = Rotary(arch).to(device)(0, windows.shape[1], dtype)
    for layer in range(arch.num_layers):
        block = load_block(source, layer, dtype, device)
        for first in range(0, x.shape[0], batch):
            x[first:first + batch] = block(x[first:first + batch], cos, sin)
        del block
        if on_layer is not None:
            on_layer(layer + 1, arch.num_layers)
    norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, arch.family.norm_shift)
    norm.weight.data = source.load("model.norm.weight", dtype=torch.float32).to(device=device, dtype=dtype)
    for first in range(0, x.shape[0], batch):
        x[first:first + batch] = norm(x[first:first + batch])
    source.release_pages()
    return x


class Head:
    """A source's LM head (`name`: its own weight or the tied embedding) as `head(h)` -> logits in
    `dtype` on `device`: held whole when it takes at most `budget` bytes in `dtype`, else read in row
    slabs of at most `budget` and `SLAB_BYTES` bytes at each call (the file's pages let go after each)."""

    def __init__(self, source: ModelSource, name: str, dtype: torch.dtype, device: torch.device | str, budget: int):
        self.source, self.name, self.dtype, self.device = source, name, dtype, device
        rows, cols = source.tensors[name].shape
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.rows, self.slab = rows, max(1, min(budget, SLAB_BYTES) // (cols * itemsize))
        self.weight = self._rows(slice(0, rows)) if rows * cols * itemsize <= budget else None

    @property
    def resident(self) -> bool:
        return self.weight is not None

    def _rows(self, rows: slice) -> torch.Tensor:
        w = self.source.load_rows(self.name, rows, dtype=torch.float32).to(device=self.device, dtype=self.dtype)
        self.source.release_pages()
        return w

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        if self.weight is not None:
            return F.linear(h, self.weight)
        return torch.cat([F.linear(h, self._rows(slice(lo, min(lo + self.slab, self.rows))))
                          for lo in range(0, self.rows, self.slab)], dim=-1)  # fmt: skip


@dataclass
class Stream:
    """A model's final hidden states over some windows, and its head: each window's log-probs on demand."""

    windows: torch.Tensor  # [n, ctx] token ids
    hidden: torch.Tensor  # [n, ctx, hidden]
    head: Head

    def log_probs(self) -> Iterator[torch.Tensor]:
        """`perplexity.log_probs` of each window in turn ([ctx-1, V] float32, one at a time)."""
        yield from head_log_probs(self.head, self.hidden)


def stream(source: ModelSource, windows: torch.Tensor, head: str, dtype: torch.dtype, device: torch.device | str,
           batch: int, head_budget: int, on_layer: Callable[[int, int], None] | None = None) -> Stream:  # fmt: skip
    """Run `source` over `windows` one block at a time (`final_hidden`) and open its head (`Head`)."""
    hidden = final_hidden(source, windows, dtype, device, batch, on_layer)
    return Stream(windows, hidden, Head(source, head, dtype, device, head_budget))

