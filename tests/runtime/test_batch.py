"""Continuous batching against the one-sequence loop: same tokens, with preemption, prefix sharing,
sampling seeds, stop strings and prompt lookup; and every block back in the pool at the end."""

import random

import pytest

from llmopt.errors import OptionError
from llmopt.model import open_model
from llmopt.model.decoder import Decoder
from llmopt.runtime.batch import BatchEngine, Request, pool_blocks
from llmopt.runtime.generate import Generator
from llmopt.runtime.paged import BlockPool
from llmopt.runtime.sampling import SamplingConfig
from tests.factories import CORPUS


@pytest.fixture(scope="module")
def tiny(tiny_models):
    with open_model(tiny_models("llama")) as src:
        return Decoder.from_source(src), src.tokenizer()


def prompts(tok, n=16):
    """`n` different prompts of different lengths (3 to about 60 tokens)."""
    words = CORPUS.split()
    return [tok.encode(" ".join(words[7 * i: 7 * i + 2 + 3 * i])) for i in range(n)]


def engine(model, tok, blocks=400, block_size=4, **kw):
    return BatchEngine(model, BlockPool(model.arch, blocks, block_size), tok, **kw)


def one_at_a_time(model, tok, requests):
    gen = Generator(model, tok)
    return [gen.generate(list(r.prompt_ids), r.max_tokens, r.sampling, r.stop, r.seed, r.ignore_eos) for r in requests]


def assert_all_blocks_back(pool):
    assert pool.available == pool.num_blocks and pool.refs == [0] * pool.num_blocks


def test_sixteen_prompts_batched_equal_each_prompt_alone(tiny):
    model, tok = tiny
    requests = [Request(p, max_tokens=6 + i, ignore_eos=True) for i, p in enumerate(prompts(tok))]
    eng = engine(model, tok, max_batch=16, token_budget=48)  # prompts arrive in chunks, mixed with decode steps
    batched = eng.run(requests)
    alone = one_at_a_time(model, tok, requests)
    assert [r.token_ids for r in batched] == [r.token_ids for r in alone]
    assert eng.forwards < sum(r.max_tokens for r in requests)  # really batched
    assert_all_blocks_back(eng.pool)


def test_preemption_by_a_tiny_pool_keeps_the_outputs(tiny):
    """A pool that holds only the longest request: sequences are preempted and recomputed."""
    model, tok = tiny
    requests = [Request(p, max_tokens=12, ignore_eos=True) for p in prompts(tok)]
    longest = max(len(r.prompt_ids) for r in requests) + 12 + 1
    eng = engine(model, tok, blocks=pool_blocks([longest], 1, 4) + 2, max_batch=16, token_budget=64)
    batched = eng.run(requests)
    assert eng.preemptions > 0
    assert [r.token_ids for r in batched] == [r.token_ids for r in one_at_a_time(model, tok, requests)]
    assert_all_blocks_back(eng.pool)


def test_shared_system_prompt_comes_from_the_prefix_cache_with_the_same_output(tiny):
    model, tok = tiny
    system = tok.encode(CORPUS[:400])
    questions = [tok.encode(q) for q in (" How vexingly", " Pack my box", " The quick brown")]
    requests = [Request(system + q, max_tokens=10, ignore_eos=True) for q in questions]
    eng = engine(model, tok, max_batch=4)
    first = eng.run(requests[:1])[0]
    rest = eng.run(requests[1:])  # the first request is done: its blocks are cached, nobody holds them
    assert first.metrics.cached_tokens == 0
    for r in rest:
        assert r.metrics.cached_tokens >= len(system) - 4 and r.metrics.cached_tokens % 4 == 0
    uncached = [engine(model, tok, max_batch=1).run([req])[0] for req in requests[1:]]
    assert [r.token_ids for r in rest] == [r.token_ids for r in uncached]
    assert [r.token_ids for r in rest] == [r.token_ids for r in one_at_a_time(model, tok, requests[1:])]


def test_sampling_seeds_and_stop_strings_are_per_request(tiny):
    model, tok = tiny
    ps = prompts(tok, 6)
    free = Generator(model, tok).generate(ps[3], 30, ignore_eos=True).text
    stop = free[len(free) // 2:len(free) // 2 + 2]  # a piece of what it would write: it must stop there
    requests = [Request(ps[0], 16, SamplingConfig(temperature=1.2, top_p=0.9), seed=7, ignore_eos=True),
                Request(ps[1], 16, SamplingConfig(temperature=0.8, top_k=20), seed=8, ignore_eos=True),
                Request(ps[2], 16, SamplingConfig(temperature=1.0, repetition_penalty=1.3), seed=9, ignore_eos=True),
                Request(ps[3], 30, stop=("zzz", stop), ignore_eos=True),
                Request(ps[4], 16, ignore_eos=True),
                Request(ps[5], 16, SamplingConfig(temperature=1.2), seed=7, ignore_eos=True)]
    batched = engine(model, tok, max_batch=6).run(requests)
    alone = one_at_a_time(model, tok, requests)
    assert [(r.token_ids, r.text) for r in batched] == [(r.token_ids, r.text) for r in alone]
    assert batched[3].metrics.stop_reason == "stop" and free.startswith(batched[3].text) and len(batched[3].text) < len(free)


def test_prompt_lookup_per_sequence_is_exact_and_drafts(tiny):
    model, tok = tiny
    repeat = tok.encode("Pack my box with five dozen liquor jugs. Pack my box with")
    requests = [Request(p, max_tokens=20, ignore_eos=True) for p in [repeat, *prompts(tok, 5)]]
    eng = engine(model, tok, max_batch=6, prompt_lookup=2, num_draft=4)
    batched = eng.run(requests)
    assert [r.token_ids for r in batched] == [r.token_ids for r in one_at_a_time(model, tok, requests)]
    assert sum(r.metrics.drafted_tokens for r in batched) > 0
    assert all(0 <= r.metrics.acceptance_rate <= 1 for r in batched if r.metrics.drafted_tokens)
    assert_all_blocks_back(eng.pool)


def test_random_workload_returns_every_block(tiny):
    """200 requests of random lengths arriving over time, some sharing prefixes, some cancelled,
    through a pool small enough to preempt and evict: the books balance after every step, and at
    the end every block is back."""
    model, _ = tiny
    rng = random.Random(0)
    vocab = model.arch.vocab_size
    prefixes = [[rng.randrange(vocab) for _ in range(rng.randrange(4, 30))] for _ in range(5)]

    def request():
        head = rng.choice(prefixes) if rng.random() < 0.5 else []
        tail = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        return Request(head + tail, max_tokens=rng.randrange(1, 16), ignore_eos=rng.random() < 0.8,
                       sampling=SamplingConfig(temperature=rng.choice([0.0, 1.0])), seed=rng.randrange(100))

    pool = BlockPool(model.arch, 40, 4)
    eng = BatchEngine(model, pool, None, max_batch=8, token_budget=32, eos={2})
    results, added = {}, 0
    while added < 200 or eng.busy:
        for _ in range(rng.randrange(0, 4)):
            if added < 200:
                eng.add(request())
                added += 1
        if eng.active and rng.random() < 0.1:
            index = rng.choice(list(eng.active))
            results[index] = eng.cancel(index)
        results.update(eng.step())
        held = [b for s in eng.running for b in s.blocks]
        assert sorted(i for i, r in enumerate(pool.refs) for _ in range(r)) == sorted(held)
        assert pool.available + len(set(held)) == pool.num_blocks
        assert all(not s.blocks for s in eng.waiting)
    assert sorted(results) == list(range(200))
    assert any(r.metrics.stop_reason == "cancelled" for r in results.values())
    assert eng.preemptions > 0 and any(r.metrics.cached_tokens for r in results.values())
    assert_all_blocks_back(pool)


def test_a_request_larger_than_the_pool_is_refused(tiny):
    model, tok = tiny
    with pytest.raises(OptionError, match="KV blocks"):
        engine(model, tok, blocks=3).add(Request(list(range(1, 20)), max_tokens=10))
    with pytest.raises(OptionError, match="max_batch"):
        engine(model, tok, max_batch=0)
