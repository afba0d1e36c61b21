"""GPTQ/RTN quality and speed on SmolLM2-135M, llmopt next to gptqmodel in the same run.

Protocol (issue 4): fp16 SmolLM2 converted by llmopt; calibrate on wikitext-2 valid.txt,
128 × 512 tokens, seed 0; perplexity on test.txt, ctx 512, 40 non-overlapping windows, scoring
tokens 1..511 of each window (fp16 gives 25.61).

gptqmodel needs torch >= 2.14 by its metadata, so it lives in its own venv that reuses this
project's torch (see benchmarks/gptq_interop.py for the recipe); pass --gptqmodel-python to run it.

Usage:
  python benchmarks/gptq.py                         # the default table of llmopt configs
  python benchmarks/gptq.py --configs gptq-w4-g128-sym rtn-w4-g128-sym --gptqmodel-python /tmp/gqvenv/bin/python
  python benchmarks/gptq.py --configs gptq-w4-g128-sym-gar --seeds 0 1 2 --gptqmodel-python ... --gptqmodel-bits 4

GPTQ's result moves by a few percent with the calibration windows (and even with their order), so
--seeds repeats every run with other windows, the same for both tools, and adds the mean per config.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.quality import llmopt_row, perplexity, print_tables, run_gptqmodel, run_llmopt, source_model  # noqa: E402

# name -> llmopt quantize options
CONFIGS: dict[str, list[str]] = {
    "rtn-w4-g128-sym": ["--method", "rtn", "--bits", "4", "--group-size", "128", "--sym"],
    "rtn-w4-g128-asym": ["--method", "rtn", "--bits", "4", "--group-size", "128", "--asym"],
    "rtn-w3-g128-sym": ["--method", "rtn", "--bits", "3", "--group-size", "128", "--sym"],
    "rtn-w3-g128-asym": ["--method", "rtn", "--bits", "3", "--group-size", "128", "--asym"],
    # gptqmodel 7.7.0's defaults: sym, no desc_act, damp 0.05, act_group_aware on (our --group-aware-order)
    "gptq-w4-g128-sym-gar": ["--method", "gptq", "--bits", "4", "--group-size", "128", "--sym", "--damp", "0.05",
                             "--group-aware-order"],
    "gptq-w3-g128-sym-gar": ["--method", "gptq", "--bits", "3", "--group-size", "128", "--sym", "--damp", "0.05",
                             "--group-aware-order"],
    # the same checkpoint format (sym, g128, no g_idx), plus llmopt's clipping search
    "gptq-w4-g128-sym-gar-mse": ["--method", "gptq", "--bits", "4", "--group-size", "128", "--sym", "--damp", "0.05",
                                 "--group-aware-order", "--mse"],
    "gptq-w3-g128-sym-gar-mse": ["--method", "gptq", "--bits", "3", "--group-size", "128", "--sym", "--damp", "0.05",
                                 "--group-aware-order", "--mse"],
    # classic GPTQ column order (what the gptqmodel numbers were compared with before)
    "gptq-w4-g128-sym": ["--method", "gptq", "--bits", "4", "--group-size", "128", "--sym", "--damp", "0.05",
                         "--no-group-aware-order"],
    "gptq-w3-g128-sym": ["--method", "gptq", "--bits", "3", "--group-size", "128", "--sym", "--damp", "0.05",
                         "--no-group-aware-order"],
    # the float32 calibration forward, for its cost and effect
    "gptq-w4-g128-sym-gar-fp32": ["--method", "gptq", "--bits", "4", "--group-size", "128", "--sym", "--damp", "0.05",
                                  "--group-aware-order", "--calib-dtype", "float32"],
    "gptq-w4-g128-asym": ["--method", "gptq", "--bits", "4", "--group-size", "128", "--asym", "--no-group-aware-order"],
    "gptq-w4-g128-asym-act-mse": ["--method", "gptq", "--bits", "4", "--group-size", "128", "--asym", "--act-order", "--mse"],
    "gptq-w4-g128-asym-act-static-mse": ["--method", "gptq", "--bits", "4", "--group-size", "128", "--asym", "--act-order", "--static-groups", "--mse"],
    "gptq-w3-g128-asym-act-mse": ["--method", "gptq", "--bits", "3", "--group-size", "128", "--asym", "--act-order", "--mse"],
    # the best 4-bit g128 found: also re-solve the scales for the final codes
    "gptq-w4-g128-asym-act-mse-refit": ["--method", "gptq", "--bits", "4", "--group-size", "128", "--asym", "--act-order", "--mse",
                                        "--refit-scales"],
    "gptq-w4-g128-asym-act-mse-refit-gptaq": ["--method", "gptq", "--bits", "4", "--group-size", "128", "--asym", "--act-order",
                                              "--mse", "--refit-scales", "--gptaq", "0.25"],
    "gptq-w4-g128-asym-act-mse-refit-self": ["--method", "gptq", "--bits", "4", "--group-size", "128", "--asym", "--act-order",
                                             "--mse", "--refit-scales", "--calib", "self"],
    "gptq-w4-g128-sym-gar-self": ["--method", "gptq", "--bits", "4", "--group-size", "128", "--sym", "--damp", "0.05",
                                  "--group-aware-order", "--calib", "self"],
}
DEFAULT = ["rtn-w4-g128-sym", "rtn-w4-g128-asym", "rtn-w3-g128-sym", "gptq-w4-g128-sym-gar", "gptq-w3-g128-sym-gar",
           "gptq-w4-g128-sym-gar-mse", "gptq-w3-g128-sym-gar-mse", "gptq-w4-g128-asym-act-mse-refit"]

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="*", default=DEFAULT, choices=sorted(CONFIGS))
    ap.add_argument("--nsamples", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0], help="Calibration seeds; each run is repeated per seed.")
    ap.add_argument("--work", default=str(ROOT / "build" / "bench-gptq"))
    ap.add_argument("--fp16", action="store_true", help="Also measure the fp16 source's perplexity.")
    ap.add_argument("--gptqmodel-python", help="A python with gptqmodel installed: run its GPTQ w4/w3 g128 too.")
    ap.add_argument("--gptqmodel-bits", nargs="*", type=int, default=[4, 3])
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    src = source_model(work)
    rows = []
    if args.fp16:
        rows.append({"config": "fp16", "ppl": round(perplexity(str(src)), 2)})
        print(json.dumps(rows[-1]), flush=True)
    for seed in args.seeds:
        suffix = "" if seed == 0 else f"-seed{seed}"  # seed 0 keeps the plain names other benchmarks read
        for name in args.configs:
            out = work / f"{name}{suffix}"
            r = run_llmopt(str(src), str(out), CONFIGS[name], args.nsamples, args.seqlen, seed)
            rows.append(llmopt_row(f"llmopt {name}", seed, out, r))
            print(json.dumps(rows[-1]), flush=True)
        for bits in args.gptqmodel_bits if args.gptqmodel_python else []:
            out = work / f"gptqmodel-w{bits}-g128{suffix}"
            if out.exists():
                shutil.rmtree(out)
            r = run_gptqmodel(args.gptqmodel_python, str(src), str(out), "gptq", bits, "default", args.nsamples,
                              args.seqlen, seed)  # fmt: skip
            rows.append({"config": f"gptqmodel w{bits} g128 sym", "seed": seed, "ppl": round(perplexity(str(out)), 2),
                         "seconds": r["seconds"], "peak_rss_mib": r["peak_rss_mib"]})
            print(json.dumps(rows[-1]), flush=True)
    print_tables(rows, args.seeds, "gptq", {"nsamples": args.nsamples, "seqlen": args.seqlen})


if __name__ == "__main__":
    main()
