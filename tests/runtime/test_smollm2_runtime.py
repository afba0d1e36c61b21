"""The runtime on the real SmolLM2-135M: exact against transformers, GGUF == HF, speculation exact."""

import pytest
import torch
import transformers

from llmopt.runtime.generate import Generator
from llmopt.model.kv_cache import StaticKVCache
from llmopt.runtime.speculative import DraftModel, PromptLookup
from llmopt.runtime.weights import load_model

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]
EDIT_PROMPT = ("Repeat the following paragraph exactly, then stop.\n\nThe committee met on Tuesday to discuss "
               "the budget for the next fiscal year. After a long debate, the members agreed to increase "
               "funding for public libraries and to reduce spending on road repairs.\n\nRepeated paragraph:\n")


@pytest.fixture(scope="module")
def ours(smollm2_hf_f32):
    return load_model(str(smollm2_hf_f32), "float32", "cpu")


@pytest.fixture(scope="module")
def reference(smollm2_hf_f32):
    return transformers.AutoModelForCausalLM.from_pretrained(smollm2_hf_f32, dtype=torch.float32).eval()


def long_prompt(tok, n=128):
    text = open("/work/shared/data/wikitext-2/test.txt").read()[:4000]
    return tok.encode(text)[:n]


def test_greedy_64_tokens_identical_to_transformers(ours, reference):
    gen = Generator(ours.model, ours.tokenizer)
    for prompt in PROMPTS:
        ids = ours.tokenizer.encode(prompt)
        mine = gen.generate(ids, 64, ignore_eos=True).token_ids
        theirs = reference.generate(torch.tensor([ids]), max_new_tokens=64, min_new_tokens=64, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        assert mine == theirs, prompt


def test_logits_on_128_tokens_match_transformers(ours, reference):
    ids = long_prompt(ours.tokenizer)
    assert len(ids) == 128
    with torch.no_grad():
        ref = reference(torch.tensor([ids])).logits[0]
        cache = StaticKVCache(ours.model.arch, 160)
        chunks = [ours.model(torch.tensor([ids[s:s + 48]]), s, cache)[0] for s in range(0, 128, 48)]
    diff = (torch.cat(chunks) - ref).abs().max().item()
    print(f"max abs logit diff vs transformers (128 tokens, chunked prefill through the cache): {diff:.2e}")
    assert diff < 1e-3


def test_gguf_directly_equals_converted_hf_dir(smollm2_gguf, ours):
    ids = torch.tensor([long_prompt(ours.tokenizer)])
    gguf = load_model(str(smollm2_gguf), "float32", "cpu")
    with torch.no_grad():
        diff = (gguf.model(ids) - ours.model(ids)).abs().max().item()
    print(f"max abs logit diff GGUF vs converted HF dir: {diff:.2e}")
    assert diff < 1e-3
    assert gguf.tokenizer.encode(PROMPTS[2]) == ours.tokenizer.encode(PROMPTS[2])


def test_speculative_greedy_equals_plain_greedy(ours, smollm2_hf):
    """Draft: the fp16 checkpoint (different numbers, same tokenizer); partial acceptance is covered
    on tiny models, where the draft is an unrelated model."""
    ids = ours.tokenizer.encode(EDIT_PROMPT)
    plain = Generator(ours.model, ours.tokenizer).generate(ids, 48, ignore_eos=True)
    draft = load_model(str(smollm2_hf), "float32", "cpu")
    with_draft = Generator(ours.model, ours.tokenizer, DraftModel(draft.model, len(ids) + 60, torch.float32, torch.device("cpu")),
                           num_draft=4).generate(ids, 48, ignore_eos=True)
    lookup = Generator(ours.model, ours.tokenizer, PromptLookup(3), num_draft=8).generate(ids, 48, ignore_eos=True)
    for spec in (with_draft, lookup):
        assert spec.token_ids == plain.token_ids
        print(spec.metrics.line())
    assert lookup.metrics.acceptance_rate > 0.5  # the answer copies the prompt
    assert lookup.metrics.target_forwards < plain.metrics.target_forwards / 2
