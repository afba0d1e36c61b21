"""Speculative decoding is exact: the rejection rule preserves the target's distribution (checked
statistically), and greedy speculation reproduces plain greedy decoding token for token."""

import pytest
import torch

from llmopt.model import open_model
from llmopt.model.decoder import Decoder
from llmopt.runtime.generate import Generator
from llmopt.runtime.sampling import SamplingConfig, probabilities, sample
from llmopt.runtime.speculative import DraftModel, PromptLookup, verify

DRAWS = 40_000
SHARP = SamplingConfig(temperature=0.05)  # random tiny models are near-uniform: sharpen them


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square goodness-of-fit p-value, pooling cells expected below 5 draws."""
    n = counts.sum()
    expected = probs.double() * n
    big = expected >= 5
    obs = torch.cat([counts[big].double(), counts[~big].double().sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    if exp[-1] == 0:
        if obs[-1] > 0:
            return 0.0
        obs, exp = obs[:-1], exp[:-1]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def load(path):
    with open_model(path) as src:
        return Decoder.from_source(src), src.tokenizer()


@pytest.fixture(scope="module")
def target_and_poor_draft(tiny_models):
    """Next-token distributions of a tiny llama (target) and an unrelated tiny qwen2 (the draft),
    at three consecutive positions of the same text."""
    target, tok = load(tiny_models("llama"))
    draft, _ = load(tiny_models("qwen2"))
    ids = torch.tensor([tok.encode("The quick brown fox jumps over the lazy")])
    with torch.no_grad():
        p = probabilities(target(ids)[0, -3:], SHARP)
        q = probabilities(draft(ids)[0, -3:], SHARP)
    return p, q


def test_rejection_rule_preserves_target_distribution(target_and_poor_draft):
    p, q = target_and_poor_draft  # rows: K=2 draft positions and the bonus position
    gen = torch.Generator().manual_seed(0)
    drafts = sample(q[:2].expand(DRAWS, 2, -1), gen)  # [DRAWS, 2], each drawn from q
    accepted, token = verify(p.expand(DRAWS, 3, -1), q[:2].expand(DRAWS, 2, -1), drafts, gen)
    first = torch.where(accepted >= 1, drafts[:, 0], token)
    vocab = p.shape[-1]
    # the draft is poor: most first drafts are rejected, so resampling carries real weight
    assert (accepted == 0).float().mean() > 0.3
    assert chi_square_p(torch.bincount(first, minlength=vocab), p[0]) > 1e-3
    # given the first draft was kept, the second emitted token follows p's second row
    kept = accepted >= 1
    second = torch.where(accepted[kept] >= 2, drafts[kept, 1], token[kept])
    assert chi_square_p(torch.bincount(second, minlength=vocab), p[1]) > 1e-3


def test_draft_alone_fails_the_same_test(target_and_poor_draft):
    p, q = target_and_poor_draft
    draws = sample(q[0].expand(DRAWS, -1), torch.Generator().manual_seed(1))
    assert chi_square_p(torch.bincount(draws, minlength=p.shape[-1]), p[0]) < 1e-3


def test_greedy_rule_is_argmax_comparison():
    p = torch.nn.functional.one_hot(torch.tensor([4, 2, 9]), 10).float()
    q = torch.nn.functional.one_hot(torch.tensor([4, 3]), 10).float()
    accepted, token = verify(p, q, torch.tensor([4, 3]))
    assert (int(accepted), int(token)) == (1, 2)
    accepted, token = verify(p, p[:2], torch.tensor([4, 2]))
    assert (int(accepted), int(token)) == (2, 9)


def test_prompt_lookup_copies_what_followed_the_latest_match():
    lookup = PromptLookup(ngram=2)
    ids = [5, 6, 7, 8, 9, 1, 5, 6, 7, 2, 6, 7]
    assert lookup.propose(ids, 3, SamplingConfig(), None)[0] == [2, 6, 7]  # "6 7" last seen before ...2
    assert lookup.propose([1, 2, 3], 3, SamplingConfig(), None)[0] == []
    assert lookup.propose([4, 1, 2, 9, 3, 2], 2, SamplingConfig(), None)[0] == [9, 3]  # falls back to 1-gram


@pytest.mark.parametrize("how", ["draft", "lookup"])
@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_speculative_greedy_equals_plain_greedy_tiny(tiny_models, how, penalty):
    target, tok = load(tiny_models("llama"))
    ids = tok.encode("Pack my box with five dozen liquor jugs. Pack my box")
    cfg = SamplingConfig(repetition_penalty=penalty)
    plain = Generator(target, tok).generate(ids, 40, cfg, ignore_eos=True)
    drafter = DraftModel(load(tiny_models("qwen2"))[0], len(ids) + 60, torch.float32, torch.device("cpu")) \
        if how == "draft" else PromptLookup(2)
    spec = Generator(target, tok, drafter, num_draft=3).generate(ids, 40, cfg, ignore_eos=True)
    assert spec.token_ids == plain.token_ids
    assert spec.metrics.drafted_tokens > 0


def test_speculative_sampling_runs_and_is_seeded(tiny_models):
    target, tok = load(tiny_models("llama"))
    ids = tok.encode("How vexingly quick")
    cfg = SamplingConfig(temperature=0.8, top_k=50)

    def run():
        drafter = DraftModel(load(tiny_models("mistral"))[0], len(ids) + 40, torch.float32, torch.device("cpu"))
        return Generator(target, tok, drafter, num_draft=4).generate(ids, 30, cfg, seed=7, ignore_eos=True)

    a, b = run(), run()
    assert a.token_ids == b.token_ids and len(a.token_ids) == 30
    assert 0 <= a.metrics.acceptance_rate <= 1
