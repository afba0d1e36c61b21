"""Qwen2-MoE in the runtime: greedy generation (row-major linears; the routed experts on their rows,
the shared expert on every row) continues a prompt with transformers' tokens; continuous batching
over the paged cache gives each prompt the tokens it gets alone. (llama.cpp's greedy tokens on our
GGUF: tests/formats/test_qwen2moe_gguf.py.)"""

from __future__ import annotations

import pytest
import torch

from llmopt.model import open_model
from llmopt.model.decoder import Decoder
from llmopt.runtime.batch import BatchEngine, Request
from llmopt.runtime.generate import Generator
from llmopt.runtime.paged import BlockPool
from llmopt.runtime.weights import load_model
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
    requests = [Request(ids(3 + 10 * i, seed=20 + i)[0].tolist(), max_tokens=8, ignore_eos=True) for i in range(4)]
    engine = BatchEngine(model, BlockPool(model.arch, 200, 4), None, max_batch=4, token_budget=40)
    batched = engine.run(requests)
    with torch.no_grad():
        alone = [Generator(model, eos=set()).generate(list(r.prompt_ids), r.max_tokens, ignore_eos=True) for r in requests]
    assert [r.token_ids for r in batched] == [r.token_ids for r in alone]

