"""`llmopt eval` (perplexity over 40 windows of 512 tokens) against llama.cpp scoring the same windows, in one run.

The files are those benchmarks/decode_formats.py writes (SmolLM2-135M as F16, Q8_0 and Q4_K_M GGUF by
default). Both engines get the same token ids (llmopt's tokenization of wikitext-2's test split, windows
of `--ctx`), the same threads, and compute the same perplexity: llmopt through `llmopt.api.evaluate`
(default flags, as `llmopt eval FILE --data ...` runs it), llama.cpp through llama-cpp-python with every
position's logits (`logits_all`, one `llama_decode` of the whole window, as `llama-perplexity` does with
`-b 512`), each window's log-softmax taken in numpy. Time is the scoring's wall time after loading
(load times apart); tokens/s = windows x ctx / time. Each engine runs `--repeats` times, alternated; the
best counts. Prints a table and one JSON line.

    python benchmarks/eval_throughput.py --threads 2 [--formats F16,Q8_0,Q4_K_M] [--windows 40] [--ctx 512]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from decode_formats import source_model, written

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "wikitext-2" / "test.txt"


def llmopt_run(path: Path, windows: torch.Tensor) -> tuple[float, float, float]:
    """(perplexity, load s, scoring s) with llmopt's runtime as `eval` loads the file by default."""
    from llmopt.eval.perplexity import evaluate
    from llmopt.runtime.weights import load_model

    start = time.perf_counter()
    model = load_model(str(path), "auto", "cpu").model
    loaded = time.perf_counter()
    result = evaluate(model, windows)
    return result.perplexity, loaded - start, time.perf_counter() - loaded


def llama_cpp_run(path: Path, windows: torch.Tensor, threads: int) -> tuple[float, float, float]:
    """(perplexity, load s, scoring s) with llama.cpp scoring every position of each window."""
    from llama_cpp import Llama

    start = time.perf_counter()
    ctx = windows.shape[1]
    llm = Llama(str(path), n_ctx=ctx, n_batch=ctx, n_ubatch=ctx, n_threads=threads, n_threads_batch=threads,
                logits_all=True, verbose=False)
    loaded = time.perf_counter()
    nll = 0.0
    for w in windows.tolist():
        llm.reset()
        llm.eval(w)
        logits = np.asarray(llm.scores[: ctx - 1], dtype=np.float32)
        top = logits.max(-1, keepdims=True)
        logz = np.log(np.exp(logits - top).sum(-1)) + top[:, 0]
        nll += float((logz - logits[np.arange(ctx - 1), w[1:]]).sum())
    n = windows.shape[0] * (ctx - 1)
    return float(np.exp(nll / n)), loaded - start, time.perf_counter() - loaded


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="F16,Q8_0,Q4_K_M")
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--workdir", type=Path, default=Path("build/decode-formats"))
    args = ap.parse_args()
    from llmopt.eval.perplexity import token_windows
    from llmopt.model import open_model

    torch.set_num_threads(args.threads)
    args.workdir.mkdir(parents=True, exist_ok=True)
    source = source_model(args.workdir, None)
    formats = args.formats.split(",")
    files = {f: written(f, source, args.workdir) for f in formats}
    with open_model(source) as src:
        windows = token_windows(src.tokenizer().encode(args.data.read_text()), args.ctx, args.windows)
    best: dict[tuple[str, str], tuple[float, float, float]] = {}
    for _ in range(args.repeats):
        for fmt in formats:
            for engine, run in (("llmopt", lambda p: llmopt_run(p, windows)),
                                ("llama.cpp", lambda p: llama_cpp_run(p, windows, args.threads))):
                got = run(files[fmt])
                if (fmt, engine) not in best or got[2] < best[(fmt, engine)][2]:
                    best[(fmt, engine)] = got
    tokens = windows.numel()
    print(f"SmolLM2-135M, CPU, {args.threads} threads, {args.windows} windows x {args.ctx} of {args.data.name}, "
          f"best of {args.repeats}")
    print(f"{'format':8} {'engine':10} {'perplexity':>10} {'load s':>7} {'score s':>8} {'tok/s':>7} {'x llama':>7}")
    rows = []
    for fmt in formats:
        peer = tokens / best[(fmt, "llama.cpp")][2]
        for engine in ("llmopt", "llama.cpp"):
            ppl, load_s, score_s = best[(fmt, engine)]
            rate = tokens / score_s
            print(f"{fmt:8} {engine:10} {ppl:10.4f} {load_s:7.2f} {score_s:8.2f} {rate:7.0f} {rate / peer:7.2f}")
            rows.append({"format": fmt, "engine": engine, "perplexity": ppl, "load_s": load_s, "score_s": score_s,
                         "tok_s": rate, "vs_llama_cpp": rate / peer})
    print(json.dumps({"benchmark": "eval_throughput", "threads": args.threads, "windows": args.windows,
                      "ctx": args.ctx, "rows": rows}))


if __name__ == "__main__":
    main()
