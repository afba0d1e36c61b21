"""Mixtral in the runtime: greedy generation (row-major linears, each expert run on its routed
tokens) continues a prompt with transformers' tokens and, on our GGUF, with llama.cpp's; continuous
batching over the paged cache gives each prompt the tokens it gets alone."""

from __future__ import annotations

import pytest
import torch

from llmopt.api import convert_to_gguf
from llmopt.model import open_model
from llmopt.model.decoder import Decoder
from llmopt.runtime.generate import Generator
from llmopt.runtime.weights import load_model
from tests.formats.gguf.llama_cpp_helpers import assert_same_greedy, llama_cpp_greedy
from tests.runtime.batching import assert_paged_batch_equals_each_prompt_alone
from tests.model.test_mixtral import ids, make_tiny_mixtral, reference


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_mixtral(tmp_path_factory.mktemp("mixtral") / "m")


def test_greedy_generation_matches_transformers(mixtral) -> None:
    prompt = ids(20, seed=9)
    ref = reference(mixtral).generate(prompt, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    runtime = load_model(str(mixtral), "float32", "cpu")
    ours = Generator(runtime.model, eos=set()).generate(prompt[0].tolist(), max_tokens=24, ignore_eos=True)
    assert ours.token_ids == ref[0, prompt.shape[1]:].tolist()


def test_greedy_on_our_gguf_matches_llama_cpp(mixtral, tmp_path) -> None:
    """32 greedy tokens on our F16 GGUF: llmopt's runtime (weights read from the expert stacks) and
    llama.cpp's."""
    out = tmp_path / "m.gguf"
    convert_to_gguf(mixtral, out, "F16")
    prompt = ids(12, seed=4)[0].tolist()
    runtime = load_model(str(out), "float32", "cpu")
    ours = Generator(runtime.model, eos=set()).generate(prompt, max_tokens=32, ignore_eos=True).token_ids
    assert_same_greedy(out, prompt, ours, llama_cpp_greedy(out, prompt, 32))


def test_paged_batch_equals_each_prompt_alone(mixtral) -> None:
    """Five prompts of 3 to 43 tokens, batched in chunks with decode steps, over 4-token blocks."""
    with open_model(mixtral) as src:
        model = Decoder.from_source(src)
    assert_paged_batch_equals_each_prompt_alone(model, ids, prompts=5, max_tokens=10)


def test_experts_kept_quantized_read_their_rows_of_the_stacks(mixtral, tmp_path, monkeypatch) -> None:
    """A Q4_K_M file run with its weights kept quantized (each expert's block rows cut from its stack)
    gives the logits of the same file dequantized."""
    import llmopt.runtime.weights as weights

    out = tmp_path / "m.gguf"
    convert_to_gguf(mixtral, out, "Q4_K_M")
    x = ids(30)
    with open_model(out) as src, torch.no_grad():
        want = Decoder.from_source(src)(x)
    monkeypatch.setattr(weights, "keep_quantized", lambda source, dtype, device: True)
    runtime = load_model(str(out), "float32", "cpu")
    assert type(runtime.model.layers[1].block_sparse_moe.experts[5].w2).__name__ != "RowMajorLinear"
    with torch.no_grad():
        assert (runtime.model(x) - want).abs().max().item() < 1e-4


@pytest.mark.slow
def test_compiled_generation_equals_eager(mixtral) -> None:
    """torch.compile'd decode (fullgraph: every expert on the step's row, unchosen ones weighted 0)
    gives the eager loop's tokens, whose experts run only on their routed rows."""
    with open_model(mixtral) as src:
        model = Decoder.from_source(src)
    eager, compiled = Generator(model, None, eos=set()), Generator(model, None, eos=set(), compile=True)
    prompt = ids(10, seed=6)[0].tolist()
    assert compiled.generate(prompt, 12).token_ids == eager.generate(prompt, 12).token_ids
