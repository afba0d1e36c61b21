"""Several windows per forward (`eval --batch N`) give the unbatched numbers up to float rounding."""

import json

import pytest

from llmopt.errors import OptionError
from llmopt.eval.perplexity import evaluate, token_windows
from llmopt.model import open_model
from llmopt.model.decoder import Decoder
from llmopt.runtime.weights import load_model
from tests.cli.test_bad_input import assert_clean_failure
from tests.factories import CORPUS


def load(path):
    with open_model(path) as src:
        return Decoder.from_source(src), src.tokenizer()


@pytest.mark.parametrize("batch", [2, 3, 5, 8])
def test_batched_equals_unbatched(tiny_models, batch):
    model, tok = load(tiny_models("llama"))
    ref, _ = load(tiny_models("mistral"))
    windows = token_windows(tok.encode(CORPUS), 32, 5)  # 5 windows: batches 2 and 3 leave a short last batch
    one = evaluate(model, windows, ref=ref)
    seen = []
    many = evaluate(model, windows, ref=ref, batch=batch, on_window=seen.append)
    assert seen == list(range(5))
    assert many.tokens_scored == one.tokens_scored
    for field in ("nll", "perplexity", "ref_perplexity", "kl_divergence"):
        assert getattr(many, field) == pytest.approx(getattr(one, field), rel=1e-5, abs=1e-7), field
    assert many.top1_agreement == pytest.approx(one.top1_agreement, abs=1 / one.tokens_scored)


def test_batched_runtime_layout(tiny_models):
    """The CPU runtime's row-major, fused model (what `llmopt eval` loads) batches the same way."""
    loaded = load_model(str(tiny_models("qwen2", True)))
    windows = token_windows(loaded.tokenizer.encode(CORPUS), 24, 4)
    assert evaluate(loaded.model, windows, batch=4).perplexity == pytest.approx(evaluate(loaded.model, windows).perplexity, rel=1e-5)


@pytest.mark.parametrize("batch", [0, -1, 10**6])
def test_bad_batch(tiny_models, batch):
    model, tok = load(tiny_models("llama"))
    with pytest.raises(OptionError, match="`batch`"):
        evaluate(model, token_windows(tok.encode(CORPUS), 32, 2), batch=batch)


def test_cli_batch(llmopt_here, tiny_models, tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text(CORPUS)
    args = ["eval", tiny_models("llama"), "--data", text, "--ctx", "32", "--windows", "4", "--json"]
    one = json.loads(llmopt_here(*args).stdout)
    four = json.loads(llmopt_here(*args, "--batch", "4").stdout)
    assert four["perplexity"] == pytest.approx(one["perplexity"], rel=1e-5)
    assert_clean_failure(llmopt_here(*args, "--batch", "0"), "--batch 0: windows per forward must be between 1 and")


@pytest.mark.slow
def test_smollm2_batched_equals_unbatched(smollm2_hf_f32):
    loaded = load_model(str(smollm2_hf_f32))
    text = open("/work/shared/data/wikitext-2/test.txt", encoding="utf-8").read()[:60000]
    windows = token_windows(loaded.tokenizer.encode(text), 256, 6)
    one = evaluate(loaded.model, windows)
    many = evaluate(loaded.model, windows, batch=4)
    assert many.perplexity == pytest.approx(one.perplexity, rel=1e-5)


def test_several_models_share_one_reference_forward(tiny_models, tmp_path, monkeypatch):
    """`eval A B --ref R` runs R's blocks once (its final hidden states kept) and its head per model; each model's
    numbers are exactly those of evaluating it alone."""
    import importlib

    api = importlib.import_module("llmopt.api.evaluate")
    from llmopt.model.decoder import Decoder as RuntimeDecoder

    data = tmp_path / "corpus.txt"
    data.write_text(CORPUS)
    models, ref = [tiny_models("llama"), tiny_models("llama", True)], tiny_models("mistral")
    alone = [api.evaluate(m, data, ctx=32, windows=3, ref=ref, batch=2, stream=False)[2] for m in models]
    forwards = []
    real = RuntimeDecoder.hidden
    monkeypatch.setattr(RuntimeDecoder, "hidden", lambda self, *a, **k: forwards.append(self.arch.num_layers) or real(self, *a, **k))
    together = [s for _, _, s in api.evaluate_files(models, data, ctx=32, windows=3, ref=ref, batch=2, stream=False)]
    assert len(forwards) == 2 * 2 + 2  # each model's 2 batches, the reference's 2 once
    for a, b in zip(alone, together, strict=True):
        for key in ("perplexity", "ref_perplexity", "kl_divergence", "top1_agreement"):
            assert a[key] == b[key], key
