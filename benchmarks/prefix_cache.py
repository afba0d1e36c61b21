"""Prefix caching and batched decode of the paged runtime (`llmopt generate --prompts`), in one run.

1. TTFT with a shared system prompt (`--system-tokens`, 1,024 by default, cut from wikitext-2): a
   first request (system prompt + question A) prefills everything; a second (same system prompt +
   question B) finds the system prompt's blocks in the prefix cache and prefills only the rest.
   Target: the second TTFT at most 20% of the first. The static cache's batch-1 TTFT on the same
   prompt stands beside them.
2. Decode throughput: `--batch` requests (short prompts, `--new-tokens` each, greedy, EOS ignored)
   run as one continuous batch against the same requests one at a time (batch 1), both through
   the paged engine, and batch 1 through the static cache.
3. What paging costs at batch 1: decode after the long prompt, static cache against paged (whose
   attention gathers each layer's keys and values through the block table every step).

Each measurement is the best of `--repeats`. Same weights (SmolLM2-135M from its GGUF, float32),
same threads. Prints a table and one JSON line.

Usage: python benchmarks/prefix_cache.py [--system-tokens 1024] [--batch 8] [--new-tokens 64] [--repeats 3] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

WIKITEXT = Path("/work/shared/data/wikitext-2/valid.txt")
FALLBACK = "The committee met on Tuesday to discuss the budget for the next fiscal year, and agreed to fund libraries. "
QUESTIONS = ["\n\nQuestion: Who wrote this text?\nAnswer:", "\n\nQuestion: Summarize the text in one line.\nAnswer:"]
SHORT = ["The capital of France is", "Once upon a time", "The best way to learn to code is", "My favourite food is",
         "In 1969, astronauts", "The weather today is", "A good book should", "Photosynthesis is the process"]


def best(fn, repeats):
    """The fastest of `repeats` runs of fn() -> (seconds-like score, result): min score and its result."""
    runs = [fn() for _ in range(repeats)]
    return min(runs, key=lambda r: r[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2-135M GGUF)")
    ap.add_argument("--system-tokens", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()

    from llmopt.api.generate import load
    from llmopt.model.embedded import smollm2_gguf
    from llmopt.runtime.batch import BatchEngine, Request, pool_blocks
    from llmopt.runtime.generate import Generator
    from llmopt.runtime.paged import BlockPool
    from llmopt.runtime.weights import set_threads

    set_threads(args.threads)
    target = load(args.model or smollm2_gguf(), dtype="float32", device="cpu", keep_quantized=False)  # every weight float32
    model, tok = target.model, target.tokenizer
    text = WIKITEXT.read_text(encoding="utf-8") if WIKITEXT.exists() else FALLBACK * 200
    system = tok.encode(text)[:args.system_tokens]
    prompts = [system + tok.encode(q) for q in QUESTIONS]
    bs = args.block_size

    def engine(max_batch: int, lengths: list[int]) -> BatchEngine:
        pool = BlockPool(model.arch, pool_blocks(lengths, max_batch, bs), bs, target.dtype, target.device)
        return BatchEngine(model, pool, tok, max_batch=max_batch, token_budget=512)

    # warm-up (first-touch page faults, rope tables, allocator): untimed, both paths
    Generator(model, tok).generate(prompts[0][:64], 2, ignore_eos=True)
    engine(1, [66 + 1]).run([Request(prompts[0][:64], max_tokens=2, ignore_eos=True)])

    # 1. TTFT: first request (cold cache) and second (shared system prompt cached), in one engine
    def ttft_pair():
        eng = engine(1, [len(p) + 2 for p in prompts])
        first, second = (eng.run([Request(p, max_tokens=1, ignore_eos=True)])[0] for p in prompts)
        return first.metrics.ttft_ms, (first, second)

    _, (first, second) = best(ttft_pair, args.repeats)
    static_ttft, _ = best(lambda: (Generator(model, tok).generate(prompts[1], 1, ignore_eos=True).metrics.ttft_ms, None),
                          args.repeats)

    # 2. decode throughput: a batch of requests at once vs one at a time
    short = [tok.encode(SHORT[i % len(SHORT)]) for i in range(args.batch)]
    requests = [Request(p, max_tokens=args.new_tokens, ignore_eos=True) for p in short]
    lengths = [len(p) + args.new_tokens + 1 for p in short]

    def throughput(max_batch):
        def run():
            eng = engine(max_batch, lengths)
            t0 = time.perf_counter()
            results = eng.run(requests)
            seconds = time.perf_counter() - t0
            return seconds, (sum(r.metrics.generated_tokens for r in results) / seconds, [r.token_ids for r in results])
        return best(run, args.repeats)[1]

    batched_tps, batched_tokens = throughput(args.batch)
    single_tps, single_tokens = throughput(1)

    def static_run():
        gen = Generator(model, tok)
        t0 = time.perf_counter()
        results = [gen.generate(r.prompt_ids, r.max_tokens, ignore_eos=True) for r in requests]
        seconds = time.perf_counter() - t0
        return seconds, (sum(r.metrics.generated_tokens for r in results) / seconds, [r.token_ids for r in results])

    static_tps, static_tokens = best(static_run, args.repeats)[1]

    # 3. batch-1 decode after the long prompt: static cache vs paged
    def long_decode_static():
        m = Generator(model, tok).generate(prompts[0], args.new_tokens, ignore_eos=True).metrics
        return -m.tokens_per_s, m.tokens_per_s

    def long_decode_paged():
        eng = engine(1, [len(prompts[0]) + args.new_tokens + 1])
        m = eng.run([Request(prompts[0], max_tokens=args.new_tokens, ignore_eos=True)])[0].metrics
        return -m.tokens_per_s, m.tokens_per_s

    long_static = best(long_decode_static, args.repeats)[1]
    long_paged = best(long_decode_paged, args.repeats)[1]

    ratio = second.metrics.ttft_ms / first.metrics.ttft_ms
    rows = [
        ("TTFT, 1st request (cold prefix cache)", f"{first.metrics.ttft_ms:.1f} ms", f"{first.metrics.prompt_tokens} tok prefilled"),
        ("TTFT, 2nd request (shared system prompt)", f"{second.metrics.ttft_ms:.1f} ms",
         f"{second.metrics.cached_tokens} of {second.metrics.prompt_tokens} tok cached; {100 * ratio:.1f}% of the 1st (target <= 20%)"),
        ("TTFT, static cache batch 1 (2nd prompt)", f"{static_ttft:.1f} ms", "no prefix cache"),
        (f"decode, paged batch {args.batch}", f"{batched_tps:.1f} tok/s", f"{batched_tps / single_tps:.2f}x batch 1; same tokens: {batched_tokens == single_tokens}"),
        ("decode, paged batch 1", f"{single_tps:.1f} tok/s", ""),
        ("decode, static cache batch 1", f"{static_tps:.1f} tok/s", f"same tokens: {static_tokens == single_tokens}"),
        (f"decode after {len(prompts[0])} tok, static batch 1", f"{long_static:.1f} tok/s", ""),
        (f"decode after {len(prompts[0])} tok, paged batch 1", f"{long_paged:.1f} tok/s",
         f"{100 * long_paged / long_static:.1f}% of the static cache's rate (block-table gather)"),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"SmolLM2-135M float32, {torch.get_num_threads()} threads, block size {bs}, best of {args.repeats}")
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>14}  {note}")
    print(json.dumps({
        "system_tokens": len(system), "ttft_first_ms": round(first.metrics.ttft_ms, 2),
        "ttft_second_ms": round(second.metrics.ttft_ms, 2), "ttft_ratio": round(ratio, 4),
        "cached_tokens": second.metrics.cached_tokens, "ttft_static_ms": round(static_ttft, 2),
        "batch": args.batch, "new_tokens": args.new_tokens, "decode_batched_tok_s": round(batched_tps, 2),
        "decode_paged_batch1_tok_s": round(single_tps, 2), "decode_static_batch1_tok_s": round(static_tps, 2),
        "batch_speedup": round(batched_tps / single_tps, 3), "same_tokens": batched_tokens == single_tokens == static_tokens,
        "long_decode_static_tok_s": round(long_static, 2), "long_decode_paged_tok_s": round(long_paged, 2),
        "threads": torch.get_num_threads(),
    }))


if __name__ == "__main__":
    main()
