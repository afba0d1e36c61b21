"""GGUF files rounded by a calibrated method against llama.cpp's own rounding with an imatrix, at the
same type and the same size: KL divergence to the float model, perplexity, top-1 agreement.

For one mix (Q4_K_M by default): the plain file (llama.cpp's searches, importance from an imatrix of
the calibration text, as llama-quantize --imatrix makes it) next to `convert --method M` for each
method, all from the same calibration text and token count, evaluated on wikitext-2 test.txt
(ctx 512, 40 windows) against the float HF model. Run it on the off-grid reference model
(--offgrid): SmolLM2's own weights sit on a Q4_1 grid and flatter every asymmetric 4-bit method.

Usage:
  python benchmarks/gguf_methods.py --offgrid --type Q4_K_M --methods awq
  python benchmarks/gguf_methods.py --offgrid --type Q4_K_M --methods awq gptq awq+gptq --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.quality import DATA, source_model, timed  # noqa: E402


def llmopt(*args: str) -> dict:
    return timed([sys.executable, "-m", "llmopt.cli.app", *args])


def evaluate_file(path: Path, ref: Path, ctx: int, windows: int) -> dict:
    from llmopt.api.evaluate import evaluate

    result, _, _ = evaluate(str(path), str(DATA / "test.txt"), ref=str(ref), ctx=ctx, windows=windows)
    return {"kld": round(result.kl_divergence, 5), "ppl": round(result.perplexity, 3),
            "top1_pct": round(100 * result.top1_agreement, 2)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--type", default="Q4_K_M")
    ap.add_argument("--methods", nargs="+", default=["awq"], choices=["gptq", "awq", "awq+gptq"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0], help="Calibration seeds of the methods' windows.")
    ap.add_argument("--nsamples", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--offgrid", action="store_true", help="Quantize the off-grid reference model instead of SmolLM2.")
    ap.add_argument("--work", default=str(ROOT / "build" / "bench-gguf-methods"))
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    src = source_model(work, args.offgrid)
    tag = ("offgrid-" if args.offgrid else "") + args.type
    calib = str(DATA / "valid.txt")
    rows = []

    # llama.cpp's way: an imatrix over the same number of calibration tokens, then the plain mix
    imatrix = work / f"{tag}-imatrix.gguf"
    llmopt("imatrix", str(src), "--calib", calib, "--chunks", str(args.nsamples), "-c", str(args.seqlen), "-o",
           str(imatrix), "--force")  # fmt: skip
    plain = work / f"{tag}-plain.gguf"
    r = llmopt("convert", str(src), "--to", "gguf", "--type", args.type, "--imatrix", str(imatrix), "-o", str(plain),
               "--force")  # fmt: skip
    rows.append({"config": f"{args.type} imatrix", "bytes": plain.stat().st_size, "seconds": r["seconds"],
                 **evaluate_file(plain, src, args.ctx, args.windows)})  # fmt: skip
    print(json.dumps(rows[-1]), flush=True)

    for seed in args.seeds:
        for method in args.methods:
            out = work / f"{tag}-{method}-seed{seed}.gguf"
            r = llmopt("convert", str(src), "--to", "gguf", "--type", args.type, "--method", method, "--calib", calib,
                       "--nsamples", str(args.nsamples), "--seqlen", str(args.seqlen), "--seed", str(seed),
                       "-o", str(out), "--force")  # fmt: skip
            rows.append({"config": f"{args.type} --method {method}", "seed": seed, "bytes": out.stat().st_size,
                         "seconds": r["seconds"], **evaluate_file(out, src, args.ctx, args.windows)})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)

    print(f"\n{'config':32} {'seed':>4} {'bytes':>11} {'KLD':>9} {'ppl':>8} {'top1 %':>7} {'seconds':>8}")
    for r in rows:
        print(f"{r['config']:32} {r.get('seed', ''):>4} {r['bytes']:>11} {r['kld']:9.5f} {r['ppl']:8.3f} "
              f"{r['top1_pct']:7.2f} {r['seconds']:>8}")  # fmt: skip
    print(json.dumps({"benchmark": "gguf_methods", "model": str(src), "type": args.type, "nsamples": args.nsamples,
                      "seqlen": args.seqlen, "ctx": args.ctx, "windows": args.windows, "rows": rows}))  # fmt: skip


if __name__ == "__main__":
    main()
