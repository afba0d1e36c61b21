"""Perplexity, KL and top-1 by the project's definition, against transformers' own loss."""

import math

import pytest
import torch
import torch.nn.functional as F
import transformers

from llmopt.errors import InputError
from llmopt.eval.gates import check_gates
from llmopt.eval.perplexity import evaluate, token_windows
from llmopt.model import open_model
from llmopt.model.decoder import Decoder
from tests.factories import CORPUS


def load(path):
    with open_model(path) as src:
        return Decoder.from_source(src), src.tokenizer()


def test_windows_are_non_overlapping_from_the_start():
    w = token_windows(list(range(100)), 16, 3)
    assert w.tolist() == [list(range(0, 16)), list(range(16, 32)), list(range(32, 48))]
    assert token_windows(list(range(100)), 16, 0).shape == (6, 16)  # 0 = all whole windows
    with pytest.raises(InputError, match="fewer than"):
        token_windows(list(range(100)), 16, 7)


def test_perplexity_equals_transformers_mean_loss(tiny_models):
    path = tiny_models("qwen2")
    model, tok = load(path)
    windows = token_windows(tok.encode(CORPUS), 64, 5)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():  # HF's loss: mean cross-entropy of tokens 1..ctx-1 given the ones before
        losses = [ref(w[None], labels=w[None]).loss.item() for w in windows]
    result = evaluate(model, windows)
    assert result.tokens_scored == 5 * 63
    assert result.perplexity == pytest.approx(math.exp(sum(losses) / len(losses)), rel=1e-5)


def test_kl_and_top1_against_a_reference(tiny_models):
    model, tok = load(tiny_models("llama"))
    other, _ = load(tiny_models("mistral"))
    windows = token_windows(tok.encode(CORPUS), 32, 4)
    same = evaluate(model, windows, ref=model)
    assert same.kl_divergence == pytest.approx(0.0, abs=1e-6) and same.top1_agreement == 1.0
    assert same.ppl_increase_pct == pytest.approx(0.0, abs=1e-9)
    diff = evaluate(model, windows, ref=other)
    with torch.no_grad():
        logp = torch.cat([model(w[None])[0, :-1] for w in windows]).log_softmax(-1)
        ref_logp = torch.cat([other(w[None])[0, :-1] for w in windows]).log_softmax(-1)
    expected_kl = F.kl_div(logp, ref_logp, log_target=True, reduction="batchmean").item()  # KL(ref || model)
    assert diff.kl_divergence == pytest.approx(expected_kl, rel=1e-4)
    assert diff.top1_agreement == pytest.approx((logp.argmax(-1) == ref_logp.argmax(-1)).float().mean().item())
    assert diff.ref_perplexity == pytest.approx(evaluate(other, windows).perplexity)


def test_gates(tiny_models):
    model, tok = load(tiny_models("llama"))
    other, _ = load(tiny_models("mistral"))
    result = evaluate(model, token_windows(tok.encode(CORPUS), 32, 2), ref=other)
    top1 = 100 * result.top1_agreement
    assert [g.passed for g in check_gates(result, min_top1=top1 - 1)] == [True]
    assert [g.passed for g in check_gates(result, min_top1=top1 + 1)] == [False]
    rise = result.ppl_increase_pct
    assert [g.passed for g in check_gates(result, max_ppl_increase=rise + 0.1)] == [True]
    assert [g.passed for g in check_gates(result, max_ppl_increase=rise - 0.1)] == [False]
    no_ref = evaluate(model, token_windows(tok.encode(CORPUS), 32, 1))
    with pytest.raises(InputError, match="`ref`"):
        check_gates(no_ref, min_top1=50)
