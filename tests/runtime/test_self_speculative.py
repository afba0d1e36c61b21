"""Self-speculative decoding (the target with layers skipped drafts into the target's own cache) is
exact: greedy output equals plain greedy decoding token for token, and sampled output follows the
target's distribution. The skip-set search scores sets as the full evaluation would."""

from collections import Counter

import pytest
import torch

from llmopt.errors import OptionError
from llmopt.model import open_model
from llmopt.model.decoder import Decoder
from llmopt.model.kv_cache import StaticKVCache
from llmopt.runtime.generate import Generator
from llmopt.runtime.sampling import SamplingConfig, probabilities
from llmopt.runtime.self_speculative import LayerSkipDraft, check_skip, skip_view
from llmopt.runtime.skip_search import WindowScorer, expected_tokens, search_skip_layers
from tests.factories import make_tiny_hf
from tests.runtime.test_speculative import chi_square_p

PROMPT = "Pack my box with five dozen liquor jugs. Pack my box"


@pytest.fixture(scope="module")
def six_layer_dir(tmp_path_factory):
    """A tiny random llama with 6 layers: enough to skip some and keep others."""
    return make_tiny_hf(tmp_path_factory.mktemp("six") / "m", "llama", layers=6)


def load(path):
    with open_model(path) as src:
        return Decoder.from_source(src), src.tokenizer()


@pytest.fixture(scope="module")
def six_layers(six_layer_dir):
    return load(six_layer_dir)


def test_skip_view_shares_every_tensor_and_leaves_the_target_whole(six_layers):
    model, tok = six_layers
    view = skip_view(model, (1, 4))
    assert len(view.layers) == 4 and len(model.layers) == 6
    assert [b.self_attn.layer for b in view.layers] == [0, 2, 3, 5]  # each block writes its own cache layer
    target_ptrs = {p.data_ptr() for p in model.parameters()}
    assert {p.data_ptr() for p in view.parameters()} <= target_ptrs  # nothing copied
    ids = torch.tensor([tok.encode(PROMPT)])
    with torch.no_grad():
        assert torch.equal(skip_view(model, ()).hidden(ids), model.hidden(ids))
        x = model.embed_tokens(ids)
        cos, sin = model.rotary(0, ids.shape[1], x.dtype)
        for i in (0, 2, 3, 5):
            x = model.layers[i](x, cos, sin)
        assert torch.allclose(view.hidden(ids), model.norm(x))


@pytest.mark.parametrize("skip", [(1,), (0, 2), (5,), (1, 3, 4)])
@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_greedy_equals_plain_greedy(six_layers, skip, penalty):
    """Whatever is skipped (the last layer too, which is the one that moves the cache's length)."""
    model, tok = six_layers
    ids = tok.encode(PROMPT)
    cfg = SamplingConfig(repetition_penalty=penalty)
    plain = Generator(model, tok).generate(ids, 40, cfg, ignore_eos=True)
    spec = Generator(model, tok, LayerSkipDraft(model, skip), num_draft=3).generate(ids, 40, cfg, ignore_eos=True)
    assert spec.token_ids == plain.token_ids
    assert spec.metrics.drafted_tokens > 0


def test_partial_acceptance_is_exercised(six_layers):
    """The exactness above covers rejections, not only all-accepted steps."""
    model, tok = six_layers
    spec = Generator(model, tok, LayerSkipDraft(model, (0, 2)), num_draft=3).generate(tok.encode(PROMPT), 40, ignore_eos=True)
    assert 0.2 < spec.metrics.acceptance_rate < 0.95


def test_one_generator_runs_several_prompts(six_layers):
    """The drafter follows the cache of each new generation (begin), not the first one's."""
    model, tok = six_layers
    gen = Generator(model, tok, LayerSkipDraft(model, (2,)), num_draft=2)
    for prompt in (PROMPT, "How vexingly quick daft zebras jump!"):
        ids = tok.encode(prompt)
        assert gen.generate(ids, 20, ignore_eos=True).token_ids == Generator(model, tok).generate(ids, 20, ignore_eos=True).token_ids


@pytest.fixture(scope="module")
def peaked(six_layer_dir):
    """The six-layer model with its LM head scaled up: random tiny models are near-uniform at
    temperature 1, where any draft would pass a distribution test; scaled, they are not."""
    model, tok = load(six_layer_dir)
    with torch.no_grad():
        model.lm_head.weight.mul_(25)
    return model, tok


DRAWS = 400
T1 = SamplingConfig(temperature=1.0)


def test_sampling_at_temperature_1_follows_the_target(peaked):
    """End to end: the first two tokens of many seeded generations. The first is sampled after the
    prefill, the second by the speculative step (drafts from the layer-skipped model, the rejection
    rule against the target); their joint frequency must match p(t1) p(t2 | t1)."""
    model, tok = peaked
    ids = tok.encode("The quick brown fox")
    skip = (5,)  # about half of its drafts are kept: both the accept and the resample paths carry weight
    gen = Generator(model, tok, LayerSkipDraft(model, skip), num_draft=2)
    pairs = Counter(tuple(gen.generate(ids, 2, T1, seed=s, ignore_eos=True).token_ids) for s in range(DRAWS))
    vocab = model.arch.vocab_size
    with torch.no_grad():
        p1 = probabilities(model(torch.tensor([ids]))[0, -1], T1)
        firsts = torch.tensor(ids).expand(vocab, -1)
        nexts = torch.cat([firsts, torch.arange(vocab)[:, None]], dim=1)  # every possible first token
        p2 = probabilities(model(nexts)[:, -1], T1)  # [vocab, vocab]: p(t2 | t1)
        q2 = probabilities(skip_view(model, skip)(nexts)[:, -1], T1)
    joint, draft_joint = (p1[:, None] * p2).flatten(), (p1[:, None] * q2).flatten()
    counts = torch.zeros(vocab * vocab)
    for (a, b), n in pairs.items():
        counts[a * vocab + b] = n
    assert chi_square_p(counts, joint) > 1e-3
    # the test has power: the draft's own second token is distributed differently
    assert (joint - draft_joint).abs().sum() / 2 > 0.2
    assert chi_square_p(counts, draft_joint) < 1e-3


def test_sampling_is_seeded(six_layers):
    model, tok = six_layers
    ids = tok.encode("How vexingly quick")
    cfg = SamplingConfig(temperature=0.8, top_k=50)
    gen = Generator(model, tok, LayerSkipDraft(model, (1, 3)), num_draft=4)
    a, b = (gen.generate(ids, 30, cfg, seed=7, ignore_eos=True) for _ in range(2))
    assert a.token_ids == b.token_ids and len(a.token_ids) == 30
    assert 0 <= a.metrics.acceptance_rate <= 1


@pytest.mark.parametrize("skip, expect", [((6,), "layers are 0 to 5"), ((-1, 2), "layers are 0 to 5"),
                                          (range(6), "keep at least one")])
def test_bad_skip_sets_are_refused(skip, expect):
    with pytest.raises(OptionError, match=expect):
        check_skip(skip, 6)


def test_propose_needs_the_target_cache(six_layers):
    model, _ = six_layers
    with pytest.raises(RuntimeError, match="begin"):
        LayerSkipDraft(model, (1,)).propose([1, 2, 3], 2, SamplingConfig(), None)


def test_expected_tokens():
    assert expected_tokens(0.0, 4) == 1.0 and expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


@pytest.mark.parametrize("cfg", [SamplingConfig(), T1])
def test_scoring_one_skipped_layer_shortcut_equals_the_full_evaluation(six_layers, cfg):
    model, tok = six_layers
    scorer = WindowScorer(model, tok.encode(PROMPT + " with five dozen"), 8, cfg, 2)
    for layer in range(6):
        assert scorer.acceptance_without(layer) == pytest.approx(scorer.acceptance((layer,)), abs=1e-5)
    assert scorer.acceptance(())[0] == pytest.approx(1.0)


def test_search_returns_a_set_and_its_numbers_without_touching_the_model(six_layers):
    model, tok = six_layers
    ids = tok.encode(PROMPT + " with five dozen liquor jugs")
    with torch.no_grad():
        before = model(torch.tensor([ids]))
    choice = search_skip_layers(model, ids, num_draft=3, window=8, patience=6, budget=60)
    with torch.no_grad():
        assert torch.equal(model(torch.tensor([ids])), before)
    assert len(choice.rounds) >= 2 and 0 < len(choice.skip) < 6
    assert choice.skip in [tuple(r["skip"]) for r in choice.rounds]
    best = max(choice.rounds, key=lambda r: r["predicted_speedup"])
    assert choice.predicted_speedup == pytest.approx(best["predicted_speedup"], abs=1e-3)
    sizes = [len(r["skip"]) for r in choice.rounds]
    assert sizes == list(range(1, len(sizes) + 1))  # one more layer each round
    assert choice.step_ms > 0 and choice.verify_ms > 0 and 0 < choice.head_ms


def test_search_window_keeps_the_target_cache_exact(six_layers):
    """The window's drafts write only their own cache; the full model's distributions at the window
    are those of a plain forward over the whole text."""
    model, tok = six_layers
    ids = tok.encode(PROMPT)
    scorer = WindowScorer(model, ids, 6, SamplingConfig(temperature=1.0), 2)
    scorer.acceptance((1, 2))
    with torch.no_grad():
        full = probabilities(model(torch.tensor([ids]))[0, -6:], SamplingConfig(temperature=1.0))
    assert torch.allclose(scorer.p, full, atol=1e-5)
    cache = StaticKVCache(model.arch, len(ids))
    with torch.no_grad():
        model.hidden(torch.tensor([ids]), 0, cache)
    start = len(ids) - 6
    for layer in range(model.arch.num_layers):
        ours, ref = scorer.cache.layer(layer)[0], cache.layer(layer)[0]
        assert torch.allclose(ours[:, :, :start], ref[:, :, :start], atol=1e-5)


@pytest.mark.slow
def test_smollm2_greedy_text_identical_with_the_searched_skip_set(smollm2_gguf):
    """The real model, float32: the set the search picks on a wikitext prompt (used even where the
    search predicts no speed-up on this machine) gives plain decoding's tokens exactly."""
    from llmopt.runtime.weights import load_model

    loaded = load_model(str(smollm2_gguf), "float32", "cpu", quantized=False)
    model, tok = loaded.model, loaded.tokenizer
    ids = tok.encode(open("/work/shared/data/wikitext-2/test.txt").read()[:4000])[:128]
    choice = search_skip_layers(model, ids, num_draft=3)
    assert choice.skip and choice.seconds < 60
    plain = Generator(model, tok).generate(ids, 48, ignore_eos=True)
    spec = Generator(model, tok, LayerSkipDraft(model, choice.skip), num_draft=3).generate(ids, 48, ignore_eos=True)
    print(choice.to_dict(), spec.metrics.line())
    assert spec.token_ids == plain.token_ids
    assert spec.text == plain.text and plain.text.strip()
    assert spec.metrics.acceptance_rate > 0.3  # the draft is the model minus a few layers: mostly right
