"""Sampling filters against transformers' logits processors (the outside reference), and seeding."""

import pytest
import torch
from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from llmopt.errors import InputError
from llmopt.runtime.sampling import SamplingConfig, apply_repetition_penalty, next_token, probabilities, sample


def reference_probs(logits, cfg):
    x = logits[None].clone()
    ids = torch.zeros(1, 1, dtype=torch.long)
    for proc in (TemperatureLogitsWarper(cfg.temperature), TopKLogitsWarper(cfg.top_k) if cfg.top_k else None,
                 TopPLogitsWarper(cfg.top_p) if cfg.top_p < 1 else None, MinPLogitsWarper(cfg.min_p) if cfg.min_p else None):
        if proc is not None:
            x = proc(ids, x)
    return x.softmax(-1)[0]


@pytest.mark.parametrize("cfg", [
    SamplingConfig(temperature=0.7),
    SamplingConfig(temperature=1.0, top_k=5),
    SamplingConfig(temperature=0.9, top_p=0.8),
    SamplingConfig(temperature=1.3, min_p=0.05),
    SamplingConfig(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02),
])
def test_filters_match_transformers(cfg):
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 3
    ours = probabilities(logits, cfg)
    ref = reference_probs(logits, cfg)
    assert torch.allclose(ours, ref, atol=1e-6)


def test_top_p_keeps_smallest_set():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = probabilities(logits, SamplingConfig(temperature=1.0, top_p=0.75)) > 0
    assert kept.tolist() == [True, True, False, False]


def test_repetition_penalty_matches_transformers():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(1))
    history = torch.tensor([3, 7, 7, 20])
    ref = RepetitionPenaltyLogitsProcessor(1.3)(history[None], logits[None].clone())[0]
    assert torch.allclose(apply_repetition_penalty(logits, history, 1.3), ref)


def test_greedy_is_argmax_after_penalty():
    logits = torch.tensor([1.0, 3.0, 2.9])
    assert next_token(logits, SamplingConfig(), torch.tensor([0])) == 1
    assert next_token(logits, SamplingConfig(repetition_penalty=1.5), torch.tensor([1])) == 2


def test_same_seed_same_draws():
    probs = torch.softmax(torch.randn(4, 100, generator=torch.Generator().manual_seed(2)), -1)
    a = sample(probs, torch.Generator().manual_seed(5))
    b = sample(probs, torch.Generator().manual_seed(5))
    assert torch.equal(a, b)


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(min_p=1.0), dict(top_k=-2), dict(repetition_penalty=0)])
def test_bad_settings_are_input_errors(bad):
    with pytest.raises(InputError):
        SamplingConfig(**bad).check()
