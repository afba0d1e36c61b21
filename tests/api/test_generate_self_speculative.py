"""`generate`'s self-speculative choice: a searched set is used only where the search predicts a
speed-up; otherwise generation is plain (same tokens), with a warning that names the prediction."""

import logging
from importlib import import_module

import pytest

from llmopt.runtime.skip_search import SkipChoice

api = import_module("llmopt.api.generate")  # the module (the package exports its `generate` function by that name)


def choice(speedup: float) -> SkipChoice:
    return SkipChoice(skip=(1,), acceptance=0.9, predicted_speedup=speedup, step_ms=10.0, head_ms=1.0,
                      verify_ms=12.0, seconds=0.5)


@pytest.mark.parametrize("speedup, used", [(1.3, True), (0.8, False)])
def test_searched_set_is_used_only_when_it_pays_off(tiny_models, monkeypatch, caplog, speedup, used):
    monkeypatch.setattr(api, "search_skip_layers", lambda *a, **k: choice(speedup))
    prompt = "Pack my box with five dozen liquor jugs. Pack my box"
    plain = api.generate(tiny_models("llama"), prompt, max_tokens=12, ignore_eos=True)
    with caplog.at_level(logging.WARNING):
        spec = api.generate(tiny_models("llama"), prompt, max_tokens=12, ignore_eos=True, self_speculative=True)
    assert spec.token_ids == plain.token_ids
    assert spec.metrics.predicted_speedup == speedup and spec.metrics.skip_search_s == 0.5
    assert spec.metrics.skip_layers == ([1] if used else [])
    assert (spec.metrics.drafted_tokens is not None) == used
    assert ("decoding plainly" in caplog.text) == (not used)
    if not used:
        assert "0.80x" in caplog.text and "best skip set 1" in caplog.text
