"""`bench`: how fast a model runs: TTFT, TPOT, prefill and decode tokens/s, weight bytes read per
second against the device's bandwidth roofline, peak memory; swept over prompt length and batch
size (in-process engines) or concurrency (a server).

Engines: llmopt's runtime (`llmopt_engine.py`: B prompts decoded in lockstep over one static KV
cache), llama.cpp in-process through llama-cpp-python (`llama_cpp_engine.py`), and any
OpenAI-compatible server (`endpoint.py`). Every engine reads the same synthetic prompts
(`prompts.py`). This module stays torch-free at import: engines are imported when they run.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from llmopt.api.bench.stats import distribution, int_list
from llmopt.errors import InputError, OptionError
from llmopt.options import BenchOptions, quantized_in_memory

ENGINES = ("llmopt", "llama.cpp")
MAX_BATCH = 4096
MAX_CONCURRENCY = 1024


@dataclass
class BenchRow:
    """One point of the sweep. Latencies in ms as {p50, p90, p99, mean}; rates per second."""

    prompt_len: int
    gen: int
    batch: int | None = None  # in-process engines: sequences decoded in lockstep
    concurrency: int | None = None  # a server: requests in flight
    requests: int = 0  # sequences (in-process) or requests sent (server)
    ok: int = 0  # of those, finished with at least one token
    generated_tokens: int = 0
    ttft_ms: dict[str, float] | None = None
    tpot_ms: dict[str, float] | None = None
    e2e_ms: dict[str, float] | None = None  # a server: each request's end-to-end latency
    prefill_tok_s: float | None = None
    decode_tok_s: float | None = None  # all sequences together
    weight_bytes_per_s: float | None = None  # the weights streamed by the decode steps
    roofline_fraction: float | None = None  # decode bytes read per second / bandwidth
    peak_memory_bytes: int | None = None
    wall_s: float | None = None
    records: list[dict] | None = None  # a server: one record per request

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class BenchReport:
    engine: str  # "llmopt", "llama.cpp" or "endpoint"
    model: str
    device: str
    threads: int | None
    seed: int
    bandwidth_gbs: float | None
    bandwidth_source: str | None
    weight_bytes: int | None
    rows: list[BenchRow] = field(default_factory=list)
    endpoint: str | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["rows"] = [r.to_dict() for r in self.rows]
        return d


def bench(model: str | Path | None = None, options: BenchOptions | None = None, *, device: str = "auto",
          warmup: bool = True, plot: str | Path | None = None, on_row: Callable[[BenchRow], None] | None = None,
          **kwargs: Any) -> BenchReport:  # fmt: skip
    """Benchmark `model` with `engine` (llmopt or llama.cpp) over every prompt length x batch size,
    or the server at `endpoint` over every prompt length x concurrency (`requests` requests each,
    `model` or `served_model`, when a path, giving the tokenizer). The options (`BenchOptions`, or
    keywords; declared in llmopt/options.py): `bandwidth`: GB/s or a catalog GPU name; measured on the
    device when omitted. `keep_quantized`: the llmopt engine keeps a quantized model's weights
    quantized (True) or dequantizes them (False); None: as `generate` does by default. `compile`: it decodes
    with `generate --compile`'s step (batch 1; it keeps quantized weights quantized, as there). With `plot`, a PNG of the sweep."""
    o = BenchOptions.merged(options, kwargs)
    lengths = int_list(o.prompt_len, "prompt_len")
    if plot is not None:
        from llmopt.eval.plotting import require_matplotlib

        require_matplotlib()
    for flag, given in (("keep_quantized", o.keep_quantized is not None), ("compile", o.compile)):
        if given and (o.endpoint is not None or o.engine not in (None, "llmopt")):
            raise OptionError(f"<{flag}> is for the llmopt engine, which holds the weights itself")
    if o.endpoint is not None:
        report = _bench_endpoint_checked(model, o, lengths, warmup, on_row)
    else:
        report = _bench_in_process_checked(model, o, lengths, device, warmup, on_row)
    if plot is not None:
        from llmopt.api.bench.plot import plot_report

        plot_report(report, Path(plot))
    return report


def _bench_endpoint_checked(model: str | Path | None, o: BenchOptions, lengths: list[int], warmup: bool,
                            on_row: Callable[[BenchRow], None] | None) -> BenchReport:  # fmt: skip
    if o.engine is not None:
        raise OptionError("choose one of <engine> and <endpoint>")
    if o.batch is not None:
        raise OptionError("<batch> is for in-process engines; a server's load is <concurrency>")
    return _bench_endpoint(o.endpoint, model, o.served_model, lengths, o.gen,
                           int_list(o.concurrency or (1,), "concurrency", high=MAX_CONCURRENCY), o.requests, o.seed,
                           o.time_limit, warmup, on_row)  # fmt: skip


def _bench_in_process_checked(model: str | Path | None, o: BenchOptions, lengths: list[int], device: str, warmup: bool,
                              on_row: Callable[[BenchRow], None] | None) -> BenchReport:  # fmt: skip
    engine = o.engine or "llmopt"
    if engine not in ENGINES:
        raise OptionError(f"<engine> {engine!r}: choose one of {', '.join(ENGINES)} (or give <endpoint> URL)")
    if o.concurrency is not None:
        raise OptionError("<concurrency> is for <endpoint>; in-process engines sweep <batch>")
    if model is None:
        raise OptionError("give the MODEL to benchmark (or <endpoint> URL)")
    batches = int_list(o.batch or (1,), "batch", high=MAX_BATCH)
    if o.compile and batches != [1]:
        raise OptionError("<compile> decodes one sequence: leave <batch> at 1")
    if o.bandwidth is not None:  # a given number or GPU name is checked before the model loads
        from llmopt.api.bench.bandwidth import resolve_bandwidth

        resolve_bandwidth(o.bandwidth, "cpu")
    return _bench_in_process(str(model), engine, lengths, o.gen, batches, o.seed, o.dtype, device, o.threads, o.bandwidth,
                             warmup, on_row, o.keep_quantized, o.compile)  # fmt: skip


def _bench_in_process(model: str, engine_name: str, lengths: list[int], gen: int, batches: list[int], seed: int,
                      dtype: str, device: str, threads: int, bandwidth: str | float | None, warmup: bool,
                      on_row: Callable[[BenchRow], None] | None,
                      keep_quantized: bool | None, compile: bool) -> BenchReport:  # fmt: skip
    from llmopt.api.bench.bandwidth import resolve_bandwidth
    from llmopt.api.bench.prompts import synthetic_prompts

    engine = _make_engine(model, engine_name, dtype, device, threads, keep_quantized, compile)
    longest = max(lengths) + gen
    if longest > engine.context:
        raise OptionError(f"<prompt_len> {max(lengths)} + <gen> {gen} = {longest} tokens: more than the model's "
                          f"context of {engine.context}")  # fmt: skip
    _check_cache_fits(engine.kv_bytes_per_token * longest * max(batches), engine.device)
    gbs, source = resolve_bandwidth(bandwidth, engine.device, threads)
    report = BenchReport(engine.name, model, engine.device, threads or None, seed, gbs, source, engine.weight_bytes)
    excluded = engine.excluded_ids()
    for length in lengths:
        for b in batches:
            prompts = synthetic_prompts(b, length, engine.vocab_size, seed, excluded)
            if warmup:  # first calls pay for allocation and kernel selection
                engine.run([p[:min(length, 16)] for p in prompts], min(gen, 2))
            row = trace_row(engine, engine.run(prompts, gen), length, gen, gbs)
            report.rows.append(row)
            if on_row:
                on_row(row)
    return report


def trace_row(engine: Any, trace: Any, length: int, gen: int, bandwidth_gbs: float | None) -> BenchRow:
    """A lockstep run's row: one TTFT for the batch, TPOT over its steps, rates, and the roofline."""
    from llmopt.plan.roofline import Device, decode_bytes_per_step, decode_tokens_per_s

    b = len(trace.tokens)
    row = BenchRow(prompt_len=length, gen=gen, batch=b, requests=b, ok=b,
                   generated_tokens=sum(len(t) for t in trace.tokens), ttft_ms=distribution([1000 * trace.ttft_s]),
                   tpot_ms=distribution([1000 * s for s in trace.step_s]), prefill_tok_s=b * length / trace.ttft_s,
                   peak_memory_bytes=trace.peak_memory_bytes, wall_s=trace.ttft_s + sum(trace.step_s))  # fmt: skip
    if trace.step_s:
        steps_per_s = len(trace.step_s) / sum(trace.step_s)
        row.decode_tok_s = b * steps_per_s
        row.weight_bytes_per_s = engine.weight_bytes * steps_per_s
        if bandwidth_gbs:  # K/V read at the mean context of the decode steps
            kv = engine.kv_bytes_per_token * (length + gen // 2)
            step_bytes = decode_bytes_per_step(engine.arch, engine.weight_bytes, 0, kv, b)
            row.roofline_fraction = steps_per_s / decode_tokens_per_s(step_bytes, Device(bandwidth_gbs))
    return row


def _make_engine(model: str, name: str, dtype: str, device: str, threads: int, keep_quantized: bool | None,
                 compile: bool) -> Any:  # fmt: skip
    if name == "llama.cpp":
        from llmopt.api.bench.llama_cpp_engine import LlamaCppEngine

        if dtype != "auto" or device not in ("auto", "cpu"):
            raise OptionError("<engine> llama.cpp runs the GGUF's own types on the CPU: leave <dtype> and <device> unset")
        return LlamaCppEngine(model, threads)
    from llmopt.api.bench.llmopt_engine import LlmoptEngine
    from llmopt.runtime.weights import load_model, set_threads

    set_threads(threads)
    loaded = load_model(model, dtype, device, quantized_in_memory(keep_quantized, compile), decode=True)
    return LlmoptEngine(loaded, compile=compile)


def _check_cache_fits(nbytes: int, device: str) -> None:
    """Refuse a sweep whose largest KV cache alone exceeds the memory available now."""
    if not device.startswith("cpu"):
        return
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return
    if nbytes > available:
        raise OptionError(f"the largest <batch> x (<prompt_len> + <gen>) needs a {nbytes / 2**30:.1f} GiB KV cache; "
                          f"{available / 2**30:.1f} GiB of memory is available")  # fmt: skip


def _bench_endpoint(url: str, model: str | Path | None, served_model: str | None, lengths: list[int], gen: int,
                    concurrencies: list[int], requests: int, seed: int, time_limit: float, warmup: bool,
                    on_row: Callable[[BenchRow], None] | None) -> BenchReport:  # fmt: skip
    from llmopt.api.bench.endpoint import Endpoint, run_requests, served_models, stream_completion
    from llmopt.api.bench.prompts import prompt_text, special_token_ids, synthetic_prompts

    ep = Endpoint.parse(url)
    tokenizer = _endpoint_tokenizer(model, served_model)
    names = served_models(ep)
    served = served_model or (names[0] if names else None)
    if served is None:
        raise InputError(f"{ep}/models lists no model; give <served_model>")
    vocab, excluded = tokenizer.vocab_size, special_token_ids(tokenizer)
    report = BenchReport("endpoint", served, "remote", None, seed, None, None, None, endpoint=str(ep))
    if warmup:
        warm = prompt_text(tokenizer, synthetic_prompts(1, min(lengths), vocab, seed + 1, excluded)[0])
        first = stream_completion(ep, served, warm, 2, timeout=time_limit)
        if not first.ok:
            raise InputError(f"{ep}: a completion failed: {first.error}")
    for length in lengths:
        prompts = [prompt_text(tokenizer, p) for p in synthetic_prompts(requests, length, vocab, seed, excluded)]
        for c in concurrencies:
            records, wall = run_requests(ep, served, prompts, gen, c, time_limit)
            row = requests_row(records, length, gen, c, wall)
            if row.ok == 0:
                raise InputError(f"{ep}: every request failed; the first: {records[0].error if records else 'none sent'}")
            report.rows.append(row)
            if on_row:
                on_row(row)
    return report


def requests_row(records: list, length: int, gen: int, concurrency: int, wall: float) -> BenchRow:
    """A server's row: percentiles over the requests that finished, throughput over the wall time.
    (No prefill rate: a request's TTFT there includes its wait in the server's queue.)"""
    ok = [r for r in records if r.ok]
    tokens = sum(r.completion_tokens for r in ok)
    tpot = [1000 * (r.e2e_s - r.ttft_s) / (r.completion_tokens - 1) for r in ok if r.completion_tokens > 1]
    return BenchRow(prompt_len=length, gen=gen, concurrency=concurrency, requests=len(records), ok=len(ok),
                    generated_tokens=tokens, ttft_ms=distribution([1000 * r.ttft_s for r in ok]),
                    tpot_ms=distribution(tpot), e2e_ms=distribution([1000 * r.e2e_s for r in ok]),
                    decode_tok_s=tokens / wall if wall > 0 else None, wall_s=wall,
                    records=[r.to_dict() for r in records])  # fmt: skip


def _endpoint_tokenizer(model: str | Path | None, served_model: str | None) -> Any:
    """The tokenizer prompts are drawn from: MODEL, else <served_model> when it names a local file or folder."""
    from llmopt.model import open_model

    spec = model if model is not None else served_model
    if spec is None or not Path(spec).expanduser().exists():
        raise OptionError("<endpoint> needs the model's tokenizer for exact prompt lengths: give MODEL (the GGUF "
                          "file or HF folder the server runs)")  # fmt: skip
    with open_model(spec) as source:
        tokenizer = source.tokenizer()
    if tokenizer is None:
        raise InputError(f"{spec}: has no tokenizer to draw prompts from")
    return tokenizer
