"""The families' shared check of continuous batching: prompts of growing length, prefilled in chunks
next to decode steps over small paged-cache blocks, get exactly the tokens each gets alone."""

from __future__ import annotations

from collections.abc import Callable

import torch

from llmopt.runtime.batch import BatchEngine, Request
from llmopt.runtime.generate import Generator
from llmopt.runtime.paged import BlockPool


def assert_paged_batch_equals_each_prompt_alone(model: torch.nn.Module, ids: Callable[..., torch.Tensor], prompts: int,
                                                max_tokens: int) -> BatchEngine:  # fmt: skip
    """`prompts` prompts of 3, 13, 23... tokens (`ids(n, seed=...)`), 4-token blocks, 40 tokens a
    forward; returns the engine (its `forwards`)."""
    requests = [Request(ids(3 + 10 * i, seed=20 + i)[0].tolist(), max_tokens=max_tokens, ignore_eos=True)
                for i in range(prompts)]  # fmt: skip
    engine = BatchEngine(model, BlockPool(model.arch, 200, 4), None, max_batch=prompts, token_budget=40)
    batched = engine.run(requests)
    with torch.no_grad():
        alone = [Generator(model, eos=set()).generate(list(r.prompt_ids), r.max_tokens, ignore_eos=True) for r in requests]
    assert [r.token_ids for r in batched] == [r.token_ids for r in alone]
    return engine
