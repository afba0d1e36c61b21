"""`llmopt bench` for llmopt's runtime and llama.cpp side by side, on the same prompts, in one run.

SmolLM2-135M (the embedded GGUF) converted once to a float32 HF folder (llmopt's engine) and to an
F16 GGUF (llama.cpp, llama-cpp-python in-process); both engines get the same synthetic prompts,
the same thread count, greedy decoding of `--gen` tokens per sequence (EOS ignored), and the
same batch sizes (B sequences decoded in lockstep). Bandwidth for the roofline is measured once
here with those threads. Target: llmopt's decode throughput at batch 8 is at least 4x batch 1.
Prints a table and one JSON line.

Usage: python benchmarks/bench_engines.py [--prompt-len 128] [--gen 64] [--batch 1,8] [--threads 2]
                                          [--workdir build/bench-engines] [--engines llmopt,llama.cpp]
Tiny check: python benchmarks/bench_engines.py --prompt-len 16 --gen 4 --batch 1,2
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from llmopt.api.bench import bench
from llmopt.api.bench.bandwidth import measure_read_bandwidth


def prepare(workdir: Path) -> dict[str, Path]:
    """The fp32 HF folder and the F16 GGUF of SmolLM2, made once under `workdir`."""
    from llmopt.api.convert import convert_to_gguf, convert_to_hf
    from llmopt.model.embedded import smollm2_gguf

    hf, gguf = workdir / "smollm2-f32", workdir / "smollm2-f16.gguf"
    if not hf.exists():
        convert_to_hf(smollm2_gguf(), hf, dtype="float32")
    if not gguf.exists():
        convert_to_gguf(hf, gguf, "F16")
    return {"llmopt": hf, "llama.cpp": gguf}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-len", default="128")
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engines", default="llmopt,llama.cpp")
    ap.add_argument("--workdir", type=Path, default=Path("build/bench-engines"))
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    models = prepare(args.workdir)
    gbs, source = measure_read_bandwidth("cpu", args.threads)
    reports = {}
    for engine in args.engines.split(","):
        reports[engine] = bench(models[engine], engine=engine, prompt_len=args.prompt_len, gen=args.gen,
                                batch=args.batch, seed=args.seed, threads=args.threads, bandwidth=gbs, device="cpu")
    print(f"SmolLM2-135M, CPU, {args.threads} threads, gen {args.gen}; bandwidth {gbs:.1f} GB/s ({source})")
    head = f"{'engine':10} {'weights MB':>10} {'prompt':>6} {'batch':>5} {'TTFT ms':>8} {'TPOT p50':>9} {'p99':>7} " \
           f"{'prefill t/s':>11} {'decode t/s':>10} {'GB/s read':>9} {'roofline':>8} {'peak MB':>8}"
    print(head)
    for engine, report in reports.items():
        for r in report.rows:
            print(f"{engine:10} {report.weight_bytes / 1e6:10.0f} {r.prompt_len:6} {r.batch:5} {r.ttft_ms['p50']:8.1f} "
                  f"{r.tpot_ms['p50'] if r.tpot_ms else 0:9.2f} {r.tpot_ms['p99'] if r.tpot_ms else 0:7.2f} "
                  f"{r.prefill_tok_s:11.0f} {r.decode_tok_s or 0:10.1f} {(r.weight_bytes_per_s or 0) / 1e9:9.2f} "
                  f"{100 * (r.roofline_fraction or 0):7.0f}% {(r.peak_memory_bytes or 0) / 1e6:8.0f}")
    speedups = {}
    for engine, report in reports.items():
        for length in sorted({r.prompt_len for r in report.rows}):
            rate = {r.batch: r.decode_tok_s for r in report.rows if r.prompt_len == length and r.decode_tok_s}
            if 1 in rate and len(rate) > 1:
                top = max(rate)
                speedups[f"{engine} prompt {length}: batch {top} / batch 1"] = rate[top] / rate[1]
    for name, x in speedups.items():
        print(f"{name}: {x:.2f}x decode throughput")
    print(json.dumps({"benchmark": "bench_engines", "threads": args.threads, "gen": args.gen, "bandwidth_gbs": gbs,
                      "speedups": speedups, "reports": {k: v.to_dict() for k, v in reports.items()}}))


if __name__ == "__main__":
    main()
