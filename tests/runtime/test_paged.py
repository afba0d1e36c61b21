"""The paged KV cache: packed attention against the static cache, block accounting, prefix names."""

import pytest
import torch

from llmopt.model import open_model
from llmopt.model.decoder import Decoder
from llmopt.model.kv_cache import StaticKVCache
from llmopt.runtime.paged import BlockPool, chain_hash, pack, prefix_hashes


@pytest.fixture(scope="module")
def tiny(tiny_models):
    with open_model(tiny_models("qwen2")) as src:  # grouped-query attention (4 heads over 2 KV heads), q/k/v biases
        return Decoder.from_source(src)


def static_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids]), 0, StaticKVCache(model.arch, len(ids)))[0]


def test_packed_paged_attention_equals_the_static_cache_for_mixed_lengths(tiny):
    """Three sequences of different lengths, in two packed forwards that mix a decode-sized chunk, a
    short chunk and long prefill chunks, crossing block boundaries: every position's logits match."""
    torch.manual_seed(0)
    vocab = tiny.arch.vocab_size
    seqs = [torch.randint(0, vocab, (n,)).tolist() for n in (6, 23, 41)]
    pool = BlockPool(tiny.arch, num_blocks=40, block_size=4)
    tables = [pool.allocate(-(-len(s) // 4)) for s in seqs]
    steps = [[(0, 5), (0, 10), (0, 17)], [(5, 6), (10, 23), (17, 41)]]  # (start, end) per sequence
    got = [[] for _ in seqs]
    with torch.no_grad():
        for step in steps:
            chunks = [(tables[i], a, b - a) for i, (a, b) in enumerate(step)]
            ids = torch.tensor([t for i, (a, b) in enumerate(step) for t in seqs[i][a:b]])
            logits = tiny.lm_head(tiny.hidden(ids[None], pack(pool, chunks, None), pool))[0]
            offset = 0
            for i, (a, b) in enumerate(step):
                got[i].append(logits[offset:offset + b - a])
                offset += b - a
    for i, s in enumerate(seqs):
        diff = (torch.cat(got[i]) - static_logits(tiny, s)).abs().max().item()
        assert diff < 1e-4, (i, diff)


def test_sliding_window_mask_matches_the_static_path(tiny_models):
    """Mistral-style sliding window (5 positions) on 20 tokens: the packed mask hides the same keys."""
    with open_model(tiny_models("mistral")) as src:
        model = Decoder.from_source(src)
    for layer in model.layers:
        layer.self_attn.window = 5
    ids = torch.randint(0, model.arch.vocab_size, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    pool = BlockPool(model.arch, num_blocks=8, block_size=4)
    table = pool.allocate(5)
    with torch.no_grad():
        first = model.lm_head(model.hidden(torch.tensor([ids[:12]]), pack(pool, [(table, 0, 12)], 5), pool))[0]
        rest = model.lm_head(model.hidden(torch.tensor([ids[12:]]), pack(pool, [(table, 12, 8)], 5), pool))[0]
    assert (torch.cat([first, rest]) - static_logits(model, ids)).abs().max().item() < 1e-4


def test_blocks_are_counted_shared_cached_and_evicted_least_recent_first(tiny):
    pool = BlockPool(tiny.arch, num_blocks=4, block_size=2)
    a = pool.allocate(2)
    assert pool.available == 2 and pool.allocate(3) is None and pool.available == 2  # all or nothing
    names = prefix_hashes([1, 2, 3, 4], 2, 2)
    for block, name in zip(a, names):
        pool.register(block, name)
    assert pool.lookup(names) == a and pool.refs[a[0]] == 2  # shared: one more holder each
    pool.release(a)
    pool.release(a)
    assert pool.available == 4 and pool.refs == [0] * 4  # cached, nobody holds them, still available
    assert pool.lookup(prefix_hashes([1, 2, 9, 9], 2, 2)) == [a[0]]  # only the first block's prefix matches
    pool.release([a[0]])
    b = pool.allocate(3)  # two never-used blocks, then the least recently released cached one: a[1]
    assert a[1] in b and a[0] not in b
    assert pool.lookup(names) == [a[0]]  # a[1]'s prefix is gone with it
    pool.release([a[0]])
    pool.release(b)
    assert pool.available == 4


def test_block_names_chain_through_every_earlier_token():
    assert chain_hash(b"", [1, 2]) == prefix_hashes([1, 2, 3, 4], 2, 1)[0]
    assert prefix_hashes([1, 2, 3, 4], 2, 2)[1] != prefix_hashes([9, 2, 3, 4], 2, 2)[1]  # same tokens, other prefix
