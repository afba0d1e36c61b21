"""Decode and prefill speed of every format llmopt writes, llmopt's runtime against llama.cpp, in one run.

For one model (SmolLM2-135M from the embedded GGUF by default, or `--random PRESET`: random weights of a
real shape, e.g. llama-3.2-1b, written as an HF folder by benchmarks/random_model.py), llmopt writes
F16, Q8_0, Q6_K, Q4_K_M, Q4_0 and IQ4_XS GGUF files and GPTQ and AWQ w4 g128 checkpoints (RTN: the speed
of a checkpoint does not depend on how its codes were chosen). Each is then run by `llmopt bench`'s
engines on the same synthetic prompt, batch 1, greedy, the same threads:

* `llmopt` with default flags (what `generate` and `eval` do without being told),
* `llmopt --keep-quantized` and `llmopt --dequantize` (the two paths the default chooses between; the
  dequantized float model is the floor no default may fall below),
* `llama.cpp` (llama-cpp-python, in-process) on the same GGUF, or on the Q4_0 file for GPTQ/AWQ.

With `--first-token`, also the time from loading a file to its first token, each engine in a fresh process
(after its imports; the whole process's wall time beside it), as a user's one-off validation run pays it
(a GPTQ/AWQ checkpoint against llama.cpp on the Q4_0 file; `--no-decode` runs only this).

Each configuration runs `--repeats` times, interleaved with the others, and the best run counts (the
least disturbed by other work on the machine). Prints a table (decode and prefill tok/s, the ratio to
llama.cpp, weight bytes read per decode step and GB/s against the measured read bandwidth) and one JSON
line.

    python benchmarks/decode_formats.py --threads 2 [--formats F16,Q4_K_M,GPTQ] [--random llama-3.2-1b]
Tiny check: python benchmarks/decode_formats.py --formats Q4_0,GPTQ --prompt-len 16 --gen 4 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from llmopt.api.bench import bench
from llmopt.api.bench.bandwidth import measure_read_bandwidth

GGUF_TYPES = ("F16", "Q8_0", "Q6_K", "Q4_K_M", "Q4_0", "IQ4_XS")
CHECKPOINTS = ("GPTQ", "AWQ")  # w4 g128, compared with llama.cpp's Q4_0 of the same model
MODES = {"default": None, "keep-quantized": True, "dequantize": False}


def source_model(workdir: Path, random_preset: str | None) -> Path:
    """The float model every file is written from: SmolLM2 in float16, or random weights of a preset's shape."""
    from llmopt.api.convert import convert_to_hf

    if random_preset is None:
        from llmopt.model.embedded import smollm2_gguf

        hf = workdir / "smollm2-f16"
        if not hf.exists():
            convert_to_hf(smollm2_gguf(), hf, dtype="float16")
        return hf
    from random_model import word_tokenizer, write_random_model

    from llmopt.plan.presets import get_preset

    hf = workdir / f"{random_preset}-random"
    if not (hf / "config.json").exists():
        arch = get_preset(random_preset).arch
        write_random_model(hf, arch, dtype="float16")
        word_tokenizer(hf, arch.vocab_size)
    return hf


def written(fmt: str, source: Path, workdir: Path) -> Path:
    """`fmt`'s file of the source, written once under `workdir` by llmopt."""
    from llmopt.api.convert import convert_to_gguf
    from llmopt.api.quantize import quantize

    if fmt in CHECKPOINTS:
        out = workdir / f"{source.name}-{fmt.lower()}-w4g128"
        if not out.exists():
            quantize(source, out, method="rtn", bits=4, group_size=128, fmt=fmt.lower())
        return out
    out = workdir / f"{source.name}-{fmt}.gguf"
    if not out.exists():
        convert_to_gguf(source, out, fmt)
    return out


PROMPT = "The three primary colors are"
FIRST_TOKEN = {  # the child's code: load the file, generate one token; prints seconds since after the imports
    "llmopt": "import sys, time, torch; from llmopt.api.generate import generate; torch.set_num_threads({threads}); "
              "t = time.perf_counter(); generate(sys.argv[1], {prompt!r}, max_tokens=1, ignore_eos=True); "
              "print(time.perf_counter() - t)",
    "llama.cpp": "import sys, time; from llama_cpp import Llama; t = time.perf_counter(); "
                 "Llama(sys.argv[1], n_threads={threads}, n_ctx=512, verbose=False)({prompt!r}, max_tokens=1); "
                 "print(time.perf_counter() - t)",
}


def first_token(engine: str, path: Path, threads: int) -> tuple[float, float]:
    """(load + first token after the imports, the whole process's wall time) in seconds, a fresh process."""
    code = FIRST_TOKEN[engine].format(threads=threads, prompt=PROMPT)
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1]), time.perf_counter() - start


def row(report) -> dict:
    r = report.rows[0]
    return {"decode_tok_s": r.decode_tok_s, "prefill_tok_s": r.prefill_tok_s, "ttft_ms": r.ttft_ms["p50"],
            "weight_bytes": report.weight_bytes, "weight_gbs": (r.weight_bytes_per_s or 0) / 1e9,
            "peak_mb": (r.peak_memory_bytes or 0) / 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default=",".join(GGUF_TYPES + CHECKPOINTS))
    ap.add_argument("--random", default=None, help="a preset (llmopt recommend's catalog) for random weights")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--first-token", action="store_true", help="also load + first token, fresh processes")
    ap.add_argument("--no-decode", dest="decode", action="store_false", help="skip the decode runs (with --first-token)")
    ap.add_argument("--workdir", type=Path, default=Path("build/decode-formats"))
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    formats = args.formats.split(",")
    source = source_model(args.workdir, args.random)
    files = {f: written(f, source, args.workdir) for f in formats}
    if any(f in CHECKPOINTS for f in formats):
        files.setdefault("Q4_0", written("Q4_0", source, args.workdir))
    gbs, where = measure_read_bandwidth("cpu", args.threads) if args.decode else (0.0, "not measured")
    runs: dict[tuple[str, str], dict] = {}

    def run(fmt: str, engine: str, mode: str) -> None:
        path = files[fmt if engine == "llmopt" else ("Q4_0" if fmt in CHECKPOINTS else fmt)]
        kw = {} if engine != "llmopt" or MODES[mode] is None else {"keep_quantized": MODES[mode]}
        report = bench(str(path), engine=engine, prompt_len=str(args.prompt_len), gen=args.gen, batch="1",
                       threads=args.threads, bandwidth=gbs, device="cpu", **kw)
        key = (fmt, engine if engine != "llmopt" else f"llmopt {mode}")
        best = runs.get(key)
        if best is None or row(report)["decode_tok_s"] > best["decode_tok_s"]:
            runs[key] = row(report)

    for _ in range(args.repeats if args.decode else 0):
        for fmt in formats:
            for mode in MODES:
                run(fmt, "llmopt", mode)
            run(fmt, "llama.cpp", "")
    name = args.random or "SmolLM2-135M"
    print(f"{name}, CPU, {args.threads} threads, prompt {args.prompt_len}, gen {args.gen}, batch 1, best of "
          f"{args.repeats}; read bandwidth {gbs:.1f} GB/s ({where})")
    print(f"{'format':8} {'engine':24} {'decode t/s':>10} {'x llama':>7} {'prefill t/s':>11} {'TTFT ms':>8} "
          f"{'MB/step':>8} {'GB/s':>6} {'of bw':>6}")
    table = []
    for fmt in formats if args.decode else ():
        peer = runs[(fmt, "llama.cpp")]["decode_tok_s"]
        for engine in [*(f"llmopt {m}" for m in MODES), "llama.cpp"]:
            r = runs[(fmt, engine)]
            ratio = r["decode_tok_s"] / peer if peer else 0.0
            label = engine if not (engine == "llama.cpp" and fmt in CHECKPOINTS) else "llama.cpp (Q4_0)"
            print(f"{fmt:8} {label:24} {r['decode_tok_s']:10.1f} {ratio:7.2f} {r['prefill_tok_s']:11.0f} "
                  f"{r['ttft_ms']:8.1f} {r['weight_bytes'] / 1e6:8.0f} {r['weight_gbs']:6.1f} "
                  f"{100 * r['weight_gbs'] / gbs:5.0f}%")
            table.append({"format": fmt, "engine": label, "vs_llama_cpp": ratio, **r})
    starts = []
    if args.first_token:
        print(f"\nload + first token (fresh process, best of {args.repeats}; whole process incl. imports in brackets)")
        for fmt in formats:
            best = {}
            for _ in range(args.repeats):
                for engine in FIRST_TOKEN:  # llama.cpp on the Q4_0 file for a checkpoint, as in decode
                    path = files["Q4_0" if engine == "llama.cpp" and fmt in CHECKPOINTS else fmt]
                    got = first_token(engine, path, args.threads)
                    best[engine] = min(best.get(engine, got), got)
            ratio = best["llmopt"][0] / best["llama.cpp"][0]
            peer = "llama.cpp" if fmt not in CHECKPOINTS else "llama.cpp (Q4_0)"
            print(f"{fmt:8} llmopt {best['llmopt'][0]:6.2f} s ({best['llmopt'][1]:5.2f})   {peer} "
                  f"{best['llama.cpp'][0]:6.2f} s ({best['llama.cpp'][1]:5.2f})   ratio {ratio:5.2f}")
            starts.append({"format": fmt, "llmopt_s": best["llmopt"], "llama_cpp_s": best["llama.cpp"], "ratio": ratio})
    print(json.dumps({"benchmark": "decode_formats", "model": name, "threads": args.threads,
                      "prompt_len": args.prompt_len, "gen": args.gen, "bandwidth_gbs": gbs, "rows": table,
                      "first_token": starts}))


if __name__ == "__main__":
    main()
