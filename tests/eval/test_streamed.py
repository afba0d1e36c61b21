"""`eval` streamed one block at a time (eval/streamed.py) gives the loaded path's numbers.

Tolerances: perplexity and reference perplexity within rel 1e-5; KL within rel 1e-5 or abs 1e-5: it is
a mean difference of float32 log-probabilities of magnitude ~10, each rounded at ~1e-6 and summed in
another order by each path (the loaded path's reference goes through its shared final hidden states),
so the two differ by ~1e-6 absolute (1.8e-6 on SmolLM2 Q4_K_M on a 2-core AVX2 machine); top-1
agreement within one position."""

import importlib

import pytest
import torch

from llmopt.api import convert_to_gguf, quantize
from llmopt.errors import OptionError
from llmopt.eval import streamed
from llmopt.model import open_model
from tests.factories import CORPUS

api = importlib.import_module("llmopt.api.evaluate")  # (the package's `evaluate` is the function)
WIKITEXT_TEST = "/work/shared/data/wikitext-2/test.txt"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "corpus.txt"
    path.write_text(CORPUS)
    return path


@pytest.fixture(scope="module")
def quantized(tiny_models, tmp_path_factory):
    """The tiny llama as GGUF Q4_K_M and Q8_0 files and as a GPTQ (RTN, 4-bit) checkpoint."""
    out = tmp_path_factory.mktemp("quantized")
    files = {}
    for mix in ("Q4_K_M", "Q8_0"):  # (the tiny model's 64-wide rows take Q4_K_M's fallback types, Q5_0 and Q8_0)
        files[mix] = out / f"llama-{mix}.gguf"
        convert_to_gguf(tiny_models("llama"), files[mix], mix)
    quantize(tiny_models("llama"), out / "gptq", method="rtn", bits=4, group_size=32)
    files["gptq"] = out / "gptq"
    return files


def assert_same(one: dict, other: dict) -> None:
    """Two summaries of one model on the same windows: the same numbers (module docstring's tolerances)."""
    assert one["tokens_scored"] == other["tokens_scored"]
    for key in ("perplexity", "ref_perplexity", "kl_divergence"):
        assert (key in one) == (key in other), key
        if key in one:
            assert other[key] == pytest.approx(one[key], rel=1e-5, abs=1e-5 if key == "kl_divergence" else 1e-7), key
    if "top1_agreement" in one:
        assert abs(other["top1_agreement"] - one["top1_agreement"]) <= 1 / one["tokens_scored"]


def both(model, corpus, **kwargs) -> tuple[dict, dict]:
    loaded = api.evaluate(model, corpus, ctx=32, windows=5, stream=False, **kwargs)[2]
    stream = api.evaluate(model, corpus, ctx=32, windows=5, stream=True, **kwargs)[2]
    assert (loaded["streamed"], stream["streamed"]) == (False, True)
    return loaded, stream


@pytest.mark.parametrize("model, ref", [("llama", "mistral"), ("qwen2-tied", None), ("llama", "llama")])
@pytest.mark.parametrize("batch", [1, 3])
def test_float_models(tiny_models, corpus, model, ref, batch):
    """HF directories, a tied head, a reference, several windows per block forward."""
    path = tiny_models("qwen2", True) if model == "qwen2-tied" else tiny_models(model)
    loaded, stream = both(path, corpus, ref=None if ref is None else tiny_models(ref), batch=batch)
    assert_same(loaded, stream)
    if ref == model:
        assert stream["kl_divergence"] == pytest.approx(0.0, abs=1e-7) and stream["top1_agreement"] == 1.0


@pytest.mark.parametrize("kind", ["Q4_K_M", "Q8_0", "gptq"])
def test_quantized_files_against_their_source(tiny_models, quantized, corpus, kind):
    """GGUF files and a GPTQ checkpoint, dequantized as each block is read, against the HF source."""
    loaded, stream = both(quantized[kind], corpus, ref=tiny_models("llama"))
    assert_same(loaded, stream)
    assert 0 < stream["kl_divergence"] and stream["top1_agreement"] < 1  # a real difference was measured


def test_head_in_row_slabs(tiny_models, corpus, monkeypatch):
    """A head over the budget is read in row slabs at each window: the logits and the numbers stay."""
    with open_model(tiny_models("llama")) as source:
        whole = streamed.Head(source, "lm_head.weight", torch.float32, "cpu", budget=1 << 30)
        rows, cols = source.tensors["lm_head.weight"].shape
        slabs = streamed.Head(source, "lm_head.weight", torch.float32, "cpu", budget=7 * cols * 4)
        assert whole.resident and not slabs.resident and slabs.slab == 7 and rows % 7
        h = torch.randn(5, cols)
        torch.testing.assert_close(slabs(h), whole(h), rtol=1e-6, atol=1e-6)
    loaded = api.evaluate(tiny_models("llama"), corpus, ctx=32, windows=5, ref=tiny_models("mistral"), stream=False)[2]
    monkeypatch.setattr(api, "device_memory", lambda device: 16 * 1000)  # a head budget of 1000 bytes: slabs
    stream = api.evaluate(tiny_models("llama"), corpus, ctx=32, windows=5, ref=tiny_models("mistral"), stream=True)[2]
    assert_same(loaded, stream)


def test_reference_computed_once_for_several_files(tiny_models, quantized, corpus, monkeypatch):
    """`evaluate_files` streams the reference once; each file's row is the loaded path's."""
    runs = []
    real = streamed.final_hidden
    monkeypatch.setattr(streamed, "final_hidden", lambda source, *a, **k: runs.append(source.path) or real(source, *a, **k))
    files = [quantized["Q4_K_M"], quantized["Q8_0"], quantized["gptq"]]
    progress = []
    rows = api.evaluate_files(files, corpus, ctx=32, windows=5, ref=tiny_models("llama"), stream=True,
                              on_window=lambda i, done, total: progress.append((i, done, total)))
    assert runs == [tiny_models("llama"), *files]
    loaded = api.evaluate_files(files, corpus, ctx=32, windows=5, ref=tiny_models("llama"), stream=False)
    for (_, _, s), (_, _, l) in zip(rows, loaded):
        assert_same(l, s)
        assert (s["bytes"], s["bits_per_weight"], s.get("pareto")) == (l["bytes"], l["bits_per_weight"], l.get("pareto"))
    # blocks of the reference (2) and the model (2), then 5 windows; later files: their blocks and windows
    assert [p for p in progress if p[0] == 0][-1] == (0, 9, 9) and [p for p in progress if p[0] == 2][-1] == (2, 7, 7)


def test_automatic_choice(tiny_models, corpus, monkeypatch):
    """Without `stream`, it streams when the model and the reference at the eval dtype exceed 3/4 of
    the memory available; a forced choice wins either way."""
    model, ref = tiny_models("llama"), tiny_models("mistral")
    with open_model(model) as a, open_model(ref) as b:
        weights = (a.parameter_count + b.parameter_count) * 4  # float32 on CPU
    run = lambda **k: api.evaluate(model, corpus, ctx=32, windows=2, ref=ref, **k)[2]["streamed"]  # noqa: E731
    monkeypatch.setattr("llmopt.runtime.weights.available_memory", lambda: weights * 4 // 3 - 8)
    assert run() is True and run(stream=False) is False
    assert run(keep_quantized=True) is False  # packed layers are the loaded path's
    monkeypatch.setattr("llmopt.runtime.weights.available_memory", lambda: weights * 4 // 3 + 8)
    assert run() is False and run(stream=True) is True
    with pytest.raises(OptionError, match="`stream` runs each block dequantized"):
        run(stream=True, keep_quantized=True)


@pytest.mark.slow
def test_smollm2_streamed_equals_loaded(smollm2_hf, tmp_path):
    """The real model: its Q4_K_M file (K-quant blocks where rows are 256-aligned) streamed against the
    fp16 source, as `eval --ref` scores it loaded."""
    q4km = tmp_path / "smollm2-Q4_K_M.gguf"
    convert_to_gguf(smollm2_hf, q4km, "Q4_K_M")
    with open_model(q4km) as source:
        assert "Q4_K" in {t.dtype for t in source.tensors.values()}
    loaded = api.evaluate(q4km, WIKITEXT_TEST, ctx=128, windows=4, ref=smollm2_hf, stream=False)[2]
    stream = api.evaluate(q4km, WIKITEXT_TEST, ctx=128, windows=4, ref=smollm2_hf, stream=True, batch=2)[2]
    print(f"SmolLM2 Q4_K_M vs fp16, 4 x 128 tokens: loaded ppl {loaded['perplexity']:.5f} KL {loaded['kl_divergence']:.6f} "
          f"top-1 {loaded['top1_agreement']:.4f}; streamed ppl {stream['perplexity']:.5f} KL {stream['kl_divergence']:.6f} "
          f"top-1 {stream['top1_agreement']:.4f}")
    assert_same(loaded, stream)
    assert stream["streamed"] and 0 < stream["kl_divergence"] < 1
