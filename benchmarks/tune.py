"""Learned rounding (`--iters`, quant/tune.py) against its start, over calibration seeds.

For each bit width and seed: `llmopt quantize` with the method alone and with `--iters N` on the
same calibration (wikitext-2 valid.txt, windows drawn by the seed), then one `llmopt eval` of every
output against the float model on held-out text (test.txt, ctx 512, 40 windows): KL divergence,
perplexity, top-1 agreement; wall time of each quantize run. The per-config means and the seed
spread are what the issue's "a margin larger than the seed-to-seed spread" is read from.

Usage (the off-grid reference model, see ../shared/tools/README.md):
  python benchmarks/tune.py --offgrid --bits 2:64:asym 3:128:sym --seeds 0 1 2 --iters 40
  python benchmarks/tune.py --offgrid --bits --schemes nvfp4a16 mxfp4a16 --seeds 0 --iters 20   # FP4's levels
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.quality import kl_scores, run_llmopt, source_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bits", nargs="*", default=["2:64:asym", "3:128:sym"], help="BITS:GROUP:sym|asym")
    ap.add_argument("--schemes", nargs="*", default=[], help="compressed-tensors schemes (nvfp4a16, mxfp4a16): "
                    "the method onto FP4's grid, tuned along its levels")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--method", default="gptq")
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--nsamples", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--offgrid", action="store_true")
    ap.add_argument("--work", default=str(ROOT / "build" / "bench-tune"))
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    src = str(source_model(work, args.offgrid))
    rows, outputs = [], []
    grids = {f"w{b} g{g} {grid}": ["--bits", b, "--group-size", g, f"--{grid}", "--format", "dense"]
             for b, g, grid in (spec.split(":") for spec in args.bits)}
    grids.update({scheme: ["--scheme", scheme] for scheme in args.schemes})
    for name, grid_options in grids.items():
        for seed in args.seeds:
            for iters in (0, args.iters):
                config = f"{args.method} {name}" + (f" +tune {iters}" if iters else "")
                out = work / f"{args.method}-{name.replace(' ', '-')}-s{seed}-i{iters}"
                options = ["--method", args.method, *grid_options, "--batch-size", str(args.batch_size), "--iters", str(iters)]
                if iters and args.lr is not None:
                    options += ["--lr", str(args.lr)]
                run = run_llmopt(src, str(out), options, args.nsamples, args.seqlen, seed)
                rows.append({"config": config, "grid": name, "seed": seed, "seconds": run["seconds"],
                             "peak_rss_mib": run["peak_rss_mib"]})  # fmt: skip
                outputs.append(str(out))
                print(f"{config} seed {seed}: {run['seconds']} s", file=sys.stderr, flush=True)
    for row, scored in zip(rows, kl_scores(outputs, src, args.windows)):
        row.update(kl=scored["kl_divergence"], ppl=scored["perplexity"], top1=scored["top1_agreement"])
    print(f"\n{'config':28} {'seed':>4} {'KL':>9} {'ppl':>9} {'top-1':>7} {'seconds':>8}")
    for r in rows:
        print(f"{r['config']:28} {r['seed']:>4} {r['kl']:9.5f} {r['ppl']:9.3f} {r['top1']:7.4f} {r['seconds']:8.1f}")
    means = []
    for config in dict.fromkeys(r["config"] for r in rows):
        kls = [r["kl"] for r in rows if r["config"] == config]
        means.append({"config": config, "seeds": len(kls), "mean_kl": statistics.mean(kls), "min_kl": min(kls),
                      "max_kl": max(kls), "mean_seconds": statistics.mean(r["seconds"] for r in rows if r["config"] == config)})  # fmt: skip
    print(f"\n{'config':28} {'seeds':>5} {'mean KL':>9} {'min':>9} {'max':>9} {'mean s':>8}")
    for m in means:
        print(f"{m['config']:28} {m['seeds']:5d} {m['mean_kl']:9.5f} {m['min_kl']:9.5f} {m['max_kl']:9.5f} {m['mean_seconds']:8.1f}")
    print(json.dumps({"benchmark": "tune", **vars(args), "rows": rows, "means": means}))


if __name__ == "__main__":
    main()
