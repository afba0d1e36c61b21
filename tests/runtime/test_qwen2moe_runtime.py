"""Qwen2-MoE in the runtime: greedy generation (row-major linears; the routed experts on their rows,
the shared expert on every row) continues a prompt with transformers' tokens; continuous batching
over the paged cache gives each prompt the tokens it gets alone. (llama.cpp's greedy tokens on our
GGUF: tests/formats/test_qwen2moe_gguf.py.)"""

from __future__ import annotations

import pytest

from llmopt.model import open_model
from llmopt.model.decoder import Decoder
from llmopt.runtime.generate import Generator
from llmopt.runtime.weights import load_model
from tests.runtime.batching import assert_paged_batch_equals_each_prompt_alone
from tests.model.test_qwen2moe import ids, make_tiny_qwen2moe, reference


@pytest.fixture(scope="module")
def qwen2moe(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_qwen2moe(tmp_path_factory.mktemp("qwen2moe") / "m")


def test_greedy_generation_matches_transformers(qwen2moe) -> None:
    prompt = ids(20, seed=9)
    ref = reference(qwen2moe).generate(prompt, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    runtime = load_model(str(qwen2moe), "float32", "cpu")
    ours = Generator(runtime.model, eos=set()).generate(prompt[0].tolist(), max_tokens=24, ignore_eos=True)
    assert ours.token_ids == ref[0, prompt.shape[1]:].tolist()


def test_paged_batch_equals_each_prompt_alone(qwen2moe) -> None:
    """Four prompts of 3 to 33 tokens, batched in chunks with decode steps, over 4-token blocks."""
    with open_model(qwen2moe) as src:
        model = Decoder.from_source(src)
    assert_paged_batch_equals_each_prompt_alone(model, ids, prompts=4, max_tokens=8)

