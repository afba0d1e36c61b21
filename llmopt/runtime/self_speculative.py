"""Self-speculative decoding: the draft is the target model itself with some layers skipped.

Training-free, as SWIFT (Xia et al. 2024) and Draft & Verify (Zhang et al. 2023): no second model,
no extra weights. The draft (`LayerSkipDraft`) runs a second `Decoder` object over the target's own
modules with a subset of its layer list (`skip_view`): every tensor is the target's, none copied.

The draft also writes into the target's own KV cache, so there is one cache and no draft prefill.
Each kept block writes its K/V at its own layer index (`Attention.layer`), so a draft step over
positions n-1 .. n+K-2 only touches those positions of the kept layers; the skipped layers'
entries there are never read by the draft. Every position below n-1 holds the full model's K/V
(written by prefill or by an earlier verification), which the draft reads as its history; the
verification pass then rewrites positions n-1 .. n+K-1 in every layer before anything reads them
as history again. The cache's valid length is put back to n-1 after drafting, so the verify pass
and the rollback of rejected tokens work exactly as with any other drafter.

The skip set comes from `--skip-layers` or from a short search on the prompt
(`runtime/skip_search.py`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from llmopt.errors import OptionError
from llmopt.model.decoder import Decoder
from llmopt.model.kv_cache import GenerationCache
from llmopt.runtime.sampling import SamplingConfig
from llmopt.runtime.speculative import draft_token


def check_skip(skip: Iterable[int], num_layers: int) -> tuple[int, ...]:
    """`skip` as sorted, distinct layer indices of a model with `num_layers` layers."""
    layers = tuple(sorted(set(skip)))
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad:
        raise OptionError(f"<skip_layers> {','.join(map(str, bad))}: this model's layers are 0 to {num_layers - 1}")
    if len(layers) == num_layers:
        raise OptionError(f"<skip_layers> skips all {num_layers} layers; keep at least one")
    return layers


def skip_view(model: Decoder, skip: Iterable[int]) -> Decoder:
    """A `Decoder` that runs `model`'s own modules without the `skip` layers.

    A second object over the same submodules: only its module registry differs (a layer list that
    leaves some blocks out), so no tensor is copied and `model` itself is untouched. Its `hidden`
    and `lm_head` are the target's code and weights."""
    skipped = set(skip)
    view = Decoder.__new__(Decoder)
    view.__dict__.update(model.__dict__)
    view._modules = dict(model._modules)  # its own registry; the target's stays as it is
    view._modules["layers"] = nn.ModuleList(b for i, b in enumerate(model.layers) if i not in skipped)
    return view


class LayerSkipDraft:
    """Drafts with the target's layers minus `skip`, in the target's own KV cache (module docstring)."""

    def __init__(self, model: Decoder, skip: Iterable[int]):
        self.skip = check_skip(skip, model.arch.num_layers)
        self.view = skip_view(model, self.skip)
        self.device = next(model.parameters()).device
        self.cache: GenerationCache | None = None

    def begin(self, cache: GenerationCache) -> None:
        self.cache = cache

    @torch.inference_mode()
    def propose(self, ids: list[int], k: int, cfg: SamplingConfig,
                generator: torch.Generator | None) -> tuple[list[int], torch.Tensor | None]:
        if self.cache is None:
            raise RuntimeError("LayerSkipDraft.propose before begin(cache): it drafts in the target's cache")
        cache = self.cache
        committed = cache.length  # == len(ids) - 1: the last id is not in the cache yet
        history = torch.tensor(ids, device=self.device)
        drafts: list[int] = []
        qs = []
        token = ids[-1]
        for i in range(k):
            pos = len(ids) - 1 + i
            h = self.view.hidden(torch.tensor([[token]], device=self.device), pos, cache)
            cache.length = pos + 1  # the last layer may be skipped, and it is the one that moves `length`
            token, q = draft_token(self.view.lm_head(h[0, -1]), history, cfg, generator)
            drafts.append(token)
            qs.append(q)
            history = torch.cat([history, history.new_tensor([token])])
        cache.truncate(committed)  # the verify pass rewrites every layer from the last id on
        return drafts, torch.stack(qs)

    def rollback(self, valid: int) -> None:
        pass  # nothing of its own: the target's cache is rolled back by the generator
