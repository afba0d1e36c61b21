"""The fixed-shape decode step (torch.compile; CUDA graphs on GPU) gives the eager decoder's tokens."""

import dataclasses

import pytest
import torch

from llmopt.model import open_model
from llmopt.model.decoder import Decoder
from llmopt.runtime.compiled import StaticDecodeStep
from llmopt.runtime.generate import Generator
from llmopt.runtime.row_major import use_row_major_linears
from llmopt.model.kv_cache import StaticKVCache


@pytest.mark.parametrize("window", [None, 5])
def test_static_step_matches_eager_logits(tiny_models, window):
    """Uncompiled, the static step is the same function as the eager decoder, sliding window included."""
    with open_model(tiny_models("mistral")) as src:
        model = Decoder.from_source(src)
    model.arch = dataclasses.replace(model.arch, sliding_window=window)
    for layer in model.layers:
        layer.self_attn.window = window
    ids = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(1))
    cache = StaticKVCache(model.arch, 32)
    step = StaticDecodeStep(model, cache)
    with torch.no_grad():
        model.hidden(ids[:, :4], 0, cache)  # prefill 4 tokens through the eager path
        for pos in range(4, 12):
            got = step(ids[0, pos:pos + 1], torch.tensor([pos]))
            want = model(ids[:, : pos + 1])[0, -1]
            assert (got - want).abs().max().item() < 1e-4


@pytest.mark.slow
def test_compiled_generation_equals_eager(tiny_models):
    """torch.compile'd decode (one compile, reused by a second, shorter prompt) gives the same tokens, on
    the linears the runtime loads a float32 model into (oneDNN's reordered weights where torch has oneDNN)."""
    with open_model(tiny_models("qwen2", True)) as src:
        model = use_row_major_linears(Decoder.from_source(src))
    eager, compiled = Generator(model, None, eos=set()), Generator(model, None, eos=set(), compile=True)
    compile_times = []
    for prompt in ([5, 17, 99, 3, 250, 41], [7, 8]):
        result = compiled.generate(prompt, 10)
        assert result.token_ids == eager.generate(prompt, 10).token_ids
        compile_times.append(result.metrics.compile_s)
    assert compiled.compiled.cache.max_len == 256
    # compiled (and run once, at the cache's last slot) before the first prefill; the second reuses it
    assert compile_times[0] > 0 and compile_times[1] is None


def test_each_compiled_step_keeps_its_own_graphs(tiny_models):
    """Two models of the same shapes, one with a sliding window: each compiled step gives its own eager
    tokens, called in turn. (The CPU step skips dynamo's guards on modules, so a graph traced from one
    module must never serve the other: each step compiles its own copy of the code.)"""
    models = []
    for window in (None, 3):
        with open_model(tiny_models("mistral")) as src:
            model = Decoder.from_source(src)
        model.arch = dataclasses.replace(model.arch, sliding_window=window)
        for layer in model.layers:
            layer.self_attn.window = window
        models.append(model)
    prompt = [5, 17, 99, 3, 250, 41, 7, 8]
    eager = [Generator(m, None, eos=set()).generate(prompt, 6).token_ids for m in models]
    assert eager[0] != eager[1]  # the window changes the tokens: sharing a graph would show
    compiled = [Generator(m, None, eos=set(), compile=True) for m in models]
    for _ in range(2):
        assert [g.generate(prompt, 6).token_ids for g in compiled] == eager
