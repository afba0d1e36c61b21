"""Gemma 3 in the runtime: the static cache's greedy loop continues a prompt with transformers'
tokens, and continuous batching over the paged cache (sliding-window layers masked by the window,
global layers not) gives each prompt the tokens it gets alone."""

from __future__ import annotations

import pytest
import torch

from llmopt.model import open_model
from llmopt.model.decoder import Decoder
from llmopt.runtime.generate import Generator
from llmopt.runtime.paged import BlockPool
from tests.runtime.batching import assert_paged_batch_equals_each_prompt_alone
from tests.model.test_gemma3 import WINDOW, ids, make_tiny_gemma3, reference


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory):
    path = make_tiny_gemma3(tmp_path_factory.mktemp("gemma3") / "g")
    with open_model(path) as src:
        return path, Decoder.from_source(src)


def test_greedy_generation_matches_transformers(gemma3) -> None:
    """24 new tokens after a 20-token prompt: decode steps run past the 16-token window."""
    path, model = gemma3
    prompt = ids(20, seed=9)
    ref = reference(path).generate(prompt, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    ours = Generator(model, eos=set()).generate(prompt[0].tolist(), max_tokens=24, ignore_eos=True)
    assert ours.token_ids == ref[0, prompt.shape[1]:].tolist()


def test_paged_batch_equals_each_prompt_alone(gemma3) -> None:
    """Six prompts of 3 to 53 tokens, batched in chunks with decode steps, over 4-token blocks."""
    _, model = gemma3
    assert 3 + 10 * 5 > 3 * WINDOW  # the longest prompt crosses the sliding window three times
    engine = assert_paged_batch_equals_each_prompt_alone(model, ids, prompts=6, max_tokens=12)
    assert engine.forwards < 6 * 12


def test_paged_prefill_logits_match_the_whole_forward(gemma3) -> None:
    """One packed forward of two prompts gives the logits the plain forward gives each."""
    from llmopt.runtime.paged import pack

    _, model = gemma3
    a, b = ids(40, seed=1)[0], ids(25, seed=2)[0]
    pool = BlockPool(model.arch, 64, 4)
    blocks = [pool.allocate(10), pool.allocate(7)]
    packed = pack(pool, [(blocks[0], 0, 40), (blocks[1], 0, 25)], model.arch.sliding_window)
    with torch.no_grad():
        hidden = model.hidden(torch.cat([a, b])[None], packed, pool)[0]
        want = torch.cat([model.hidden(a[None])[0], model.hidden(b[None])[0]])
    assert (hidden - want).abs().max().item() < 1e-4


def test_static_step_matches_eager_logits(gemma3) -> None:
    """The fixed-shape decode step (what torch.compile compiles) selects each layer's rope table from
    the full table and masks each layer by its own window, as the eager decoder does, past the window."""
    from llmopt.model.kv_cache import StaticKVCache
    from llmopt.runtime.compiled import StaticDecodeStep

    _, model = gemma3
    x = ids(40, seed=4)
    cache = StaticKVCache(model.arch, 64)
    step = StaticDecodeStep(model, cache)
    with torch.no_grad():
        model.hidden(x[:, :8], 0, cache)
        for pos in range(8, 40):
            got = step(x[0, pos:pos + 1], torch.tensor([pos]))
            want = model(x[:, : pos + 1])[0, -1]
            assert (got - want).abs().max().item() < 1e-4, pos
