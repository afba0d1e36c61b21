"""The llama.cpp engine (llama-cpp-python's C API, driven in lockstep) against llama-cpp-python's
own high-level greedy generation, on a tiny GGUF and on SmolLM2."""

import numpy as np
import pytest

from llmopt.api.bench.llama_cpp_engine import LlamaCppEngine
from llmopt.api.bench.prompts import synthetic_prompts
from tests.formats.gguf.llama_cpp_helpers import assert_near_tie, first_difference

llama_cpp = pytest.importorskip("llama_cpp")  # a test extra; the CLI's one-line error covers its absence


def reference(path, prompt, gen):
    """llama-cpp-python's Llama.generate, greedy (top_k 1), one sequence: its tokens and each step's logits.
    With flash attention, as the engine's context (llama.cpp's default, AUTO, takes it on the CPU): the
    other kernel moves SmolLM2's logits by up to ~0.2 and flips its near-ties."""
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=len(prompt) + gen + 8, n_threads=1, verbose=False, logits_all=True,
                          flash_attn=True)
    out = []
    for token in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
        out.append(token)
        if len(out) == gen:
            break
    return out, np.asarray(llm.scores[len(prompt) - 1: len(prompt) - 1 + gen])


def check_engine(path, length, gen, batch):
    engine = LlamaCppEngine(str(path), threads=1)
    prompts = synthetic_prompts(batch, length, engine.vocab_size, seed=2, exclude=engine.excluded_ids())
    trace = engine.run(prompts, gen)
    assert [len(t) for t in trace.tokens] == [gen] * batch and len(trace.step_s) == gen - 1
    for prompt, tokens in zip(prompts, trace.tokens):
        expected, logits = reference(path, prompt, gen)
        # A batch runs other kernels than one sequence: a near-tie may break the other way (then the
        # continuations differ and are no longer comparable).
        first = first_difference(tokens, expected)
        if first is not None:
            assert_near_tie(first, gen, float(logits[first][expected[first]] - logits[first][tokens[first]]))
    return engine


def test_tiny_gguf_lockstep_matches_llama_generate(tiny_ggufs):
    path = tiny_ggufs("llama")
    engine = check_engine(path, 20, 10, 3)
    # llama.cpp's own count of its tensor bytes, less the untied F32 embedding table (vocab x hidden)
    embed = engine.arch.vocab_size * engine.arch.hidden_size * 4
    assert engine.weight_bytes == llama_cpp.llama_model_size(engine.model) - embed


@pytest.mark.slow
def test_smollm2_lockstep_matches_llama_generate(smollm2_gguf):
    check_engine(smollm2_gguf, 64, 8, 2)
