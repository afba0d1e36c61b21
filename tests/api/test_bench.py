"""`bench`'s parts on tiny random models: statistics, prompts, and the lockstep batched decode,
whose greedy tokens must be batch 1's (llmopt's Generator and transformers' generate)."""

import random

import numpy as np
import pytest
import torch
import transformers

from llmopt.api.bench import BenchRow, requests_row, trace_row
from llmopt.api.bench.endpoint import Endpoint, RequestRecord
from llmopt.api.bench.llmopt_engine import LlmoptEngine, decode_weight_bytes
from llmopt.api.bench.prompts import prompt_text, special_token_ids, synthetic_prompts
from llmopt.api.bench.stats import distribution, int_list, percentile
from llmopt.api.bench.trace import Trace
from llmopt.errors import OptionError
from llmopt.plan.roofline import Device, decode_bytes_per_step, decode_tokens_per_s
from llmopt.runtime.generate import Generator
from llmopt.runtime.sampling import SamplingConfig
from llmopt.runtime.weights import load_model


@pytest.mark.parametrize("n", [1, 2, 7, 100])
def test_percentiles_match_numpy(n):
    rng = random.Random(n)
    values = [rng.expovariate(1.0) for _ in range(n)]
    for q in (0, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12)
    d = distribution(values)
    assert d["mean"] == pytest.approx(float(np.mean(values)))
    assert d["p50"] <= d["p90"] <= d["p99"]
    assert distribution([]) is None


def test_int_lists():
    assert int_list("128, 512,2048", "prompt_len") == [128, 512, 2048]
    assert int_list("4,4,1", "batch") == [4, 1]
    assert int_list([1, 8], "batch") == [1, 8]
    for bad, match in (("a,b", "expected integers"), ("0", "between 1"), ("", "expected integers"), ("1,,2", "expected")):
        with pytest.raises(OptionError, match=match):
            int_list(bad, "batch")


def test_prompts_are_seeded_exact_and_free_of_special_tokens():
    a = synthetic_prompts(4, 50, 320, seed=3, exclude={0, 1, 2})
    assert a == synthetic_prompts(4, 50, 320, seed=3, exclude={0, 1, 2})
    assert synthetic_prompts(2, 50, 320, seed=3, exclude={0, 1, 2}) == a[:2]  # batch 2 runs batch 4's first prompts
    assert a != synthetic_prompts(4, 50, 320, seed=4, exclude={0, 1, 2})
    assert all(len(p) == 50 and not {0, 1, 2} & set(p) and max(p) < 320 for p in a)
    assert len({tuple(p) for p in a}) == 4


def test_prompt_text_reads_back_as_the_length(tiny_models):
    tok = load_model(str(tiny_models("llama"))).tokenizer
    for length in (5, 40, 200):
        for ids in synthetic_prompts(3, length, tok.vocab_size, exclude=special_token_ids(tok)):
            text = prompt_text(tok, ids)
            assert len(tok.tokenizer.encode(text, add_special_tokens=False).ids) == length


@pytest.mark.slow
def test_the_compiled_engine_gives_the_eager_tokens(tiny_models):
    """`bench --compile`: generate --compile's step, compiled once when the first run builds its cache
    (outside the timing), gives the eager engine's tokens, and a second run reuses it."""
    loaded = load_model(str(tiny_models("llama")), quantized=True)
    eager = LlmoptEngine(loaded)
    prompts = synthetic_prompts(1, 21, eager.vocab_size, seed=2, exclude=eager.excluded_ids())
    want = eager.run(prompts, 10).tokens
    compiled = LlmoptEngine(loaded, compile=True)
    first = compiled.run(prompts, 10)
    assert first.tokens == want and len(first.step_s) == 9
    assert compiled.compiled.built_s is not None  # it compiled in this run
    assert compiled.run(prompts, 10).tokens == want and compiled.compiled.built_s is None


@pytest.mark.parametrize("family,tie", [("llama", False), ("qwen2", True)])
def test_lockstep_batch_gives_batch_one_tokens(tiny_models, family, tie):
    path = tiny_models(family, tie)
    loaded = load_model(str(path), quantized=True)
    engine = LlmoptEngine(loaded, prefill_chunk=16)  # several prefill chunks
    prompts = synthetic_prompts(4, 37, engine.vocab_size, seed=1, exclude=engine.excluded_ids())
    batched = engine.run(prompts, 12)
    assert [len(t) for t in batched.tokens] == [12] * 4 and len(batched.step_s) == 11
    assert batched.ttft_s > 0 and all(s > 0 for s in batched.step_s)
    gen = Generator(loaded.model, loaded.tokenizer)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt, tokens in zip(prompts, batched.tokens):
        assert engine.run([prompt], 12).tokens[0] == tokens
        assert gen.generate(prompt, 12, SamplingConfig(), ignore_eos=True).token_ids == tokens
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
        assert out[0, len(prompt):].tolist() == tokens


def test_weight_bytes_count_a_tied_table_once_and_skip_an_untied_one(tiny_models):
    untied = load_model(str(tiny_models("llama", False))).model
    tied = load_model(str(tiny_models("llama", True))).model

    def weights(model) -> int:  # noqa: ANN001 - parameters and the linears' weights (oneDNN's are buffers), once each
        tensors = [*model.parameters(), *(b for n, b in model.named_buffers() if not n.startswith("rotary."))]
        return sum(t.numel() for t in {id(t) if t.is_mkldnn else t.data_ptr(): t for t in tensors}.values())

    embed = untied.arch.vocab_size * untied.arch.hidden_size
    # llmopt's CPU layout pads the LM head's slabs; the tiny head (320 columns) is one slab, no padding
    assert decode_weight_bytes(untied) == 4 * (weights(untied) - embed)
    assert decode_weight_bytes(tied) == 4 * weights(tied)
    linears = 2 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 64 * 128)  # tiny llama: 2 layers, hidden 64, 2 of 4 KV heads, ffn 128
    assert weights(untied) - embed == linears + 320 * 64 + 64 * 5  # + the head and the five norms


class _Engine:
    arch = None
    weight_bytes = 10**9
    kv_bytes_per_token = 1000


def test_trace_row_rates_and_roofline(tiny_models):
    arch = load_model(str(tiny_models("llama"))).model.arch
    engine = _Engine()
    engine.arch = arch
    trace = Trace(tokens=[[1] * 5, [2] * 5], ttft_s=0.5, step_s=[0.1, 0.1, 0.2, 0.2], peak_memory_bytes=123)
    row = trace_row(engine, trace, length=100, gen=5, bandwidth_gbs=20.0)
    assert row.batch == 2 and row.generated_tokens == 10 and row.peak_memory_bytes == 123
    assert row.prefill_tok_s == pytest.approx(2 * 100 / 0.5)
    assert row.decode_tok_s == pytest.approx(2 * 4 / 0.6)
    assert row.weight_bytes_per_s == pytest.approx(1e9 * 4 / 0.6)
    step_bytes = decode_bytes_per_step(arch, 10**9, 0, 1000 * (100 + 2), 2)
    assert row.roofline_fraction == pytest.approx((4 / 0.6) / decode_tokens_per_s(step_bytes, Device(20.0)))
    assert row.tpot_ms["p50"] == pytest.approx(150.0) and row.ttft_ms["p99"] == pytest.approx(500.0)


def test_requests_row_counts_and_latencies():
    records = [RequestRecord(True, 0.1, 1.1, 11, 50), RequestRecord(True, 0.2, 0.7, 6, 50),
               RequestRecord(False, None, 0.05, 0, None, "HTTP 500: boom")]
    row = requests_row(records, 50, 11, 2, wall=2.0)
    assert isinstance(row, BenchRow) and (row.requests, row.ok, row.generated_tokens) == (3, 2, 17)
    assert row.ttft_ms["p50"] == pytest.approx(150.0) and row.e2e_ms["p50"] == pytest.approx(900.0)
    assert row.tpot_ms["mean"] == pytest.approx((100.0 + 100.0) / 2)
    assert row.decode_tok_s == pytest.approx(17 / 2.0) and row.records[2]["error"] == "HTTP 500: boom"


def test_endpoint_addresses():
    ep = Endpoint.parse("http://127.0.0.1:8080/v1/")
    assert (ep.host, ep.port, ep.base_path, str(ep)) == ("127.0.0.1", 8080, "/v1", "http://127.0.0.1:8080/v1")
    assert Endpoint.parse("http://localhost:9/v1/completions").base_path == "/v1"
    for bad in ("ftp://x/v1", "127.0.0.1:8080", "http://:80/v1", "http://h:99999999/v1"):
        with pytest.raises(OptionError, match="endpoint"):
            Endpoint.parse(bad)


@pytest.mark.slow
def test_smollm2_lockstep_batch_gives_batch_one_tokens(smollm2_hf_f32):
    loaded = load_model(str(smollm2_hf_f32))
    engine = LlmoptEngine(loaded)
    prompts = synthetic_prompts(4, 48, engine.vocab_size, seed=0, exclude=engine.excluded_ids())
    batched = engine.run(prompts, 16)
    gen = Generator(loaded.model, loaded.tokenizer)
    for prompt, tokens in zip(prompts, batched.tokens):
        assert gen.generate(prompt, 16, SamplingConfig(), ignore_eos=True).token_ids == tokens
