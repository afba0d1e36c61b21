"""Layer inputs for calibration: the embeddings of the token samples, and hooks that see a linear's input.

The pipeline runs blocks itself; these pieces only observe. The embedding matrix is read from the
source once, in its stored dtype, and dropped, so the model is never resident.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from llmopt.model.decoder import embed_scaled
from llmopt.model.source import ModelSource


def embed(source: ModelSource, tokens: torch.Tensor, dtype: torch.dtype = torch.float32,
          device: torch.device | str = "cpu") -> torch.Tensor:
    """Hidden states entering block 0 for `tokens` [n, t]: [n, t, hidden]."""
    table = source.load("model.embed_tokens.weight", dtype=None)  # as stored (half of float32 for bf16 files)
    x = embed_scaled(table[tokens.clamp(0, table.shape[0] - 1)].to(device=device, dtype=torch.float32).to(dtype), source.arch)
    del table
    source.release_pages()
    return x


class StopForward(Exception):
    """Raised by a capture hook to end a forward pass once the wanted input has been seen."""


@contextmanager
def capture_inputs(module: nn.Module, sink: Callable[[torch.Tensor], None], stop: bool = False) -> Iterator[None]:
    """Call `sink(x)` with every input `module` receives; with `stop`, end the forward right there."""

    def hook(_mod: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        sink(args[0].detach())
        if stop:
            raise StopForward

    handle = module.register_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()
