"""AWQ quality and speed on SmolLM2-135M (and on the off-grid reference model), llmopt next to
gptqmodel's AWQ in the same run, over seeds.

The protocol is benchmarks/quality.py's (wikitext-2 valid.txt 128 × 512 calibration, test.txt
ctx 512 40 windows). The configs answer issue 14's questions:
- w4 g128 asym: AWQ against round-to-nearest and against gptqmodel's AWQ (at its defaults, which
  are symmetric, and asymmetric for the same format as ours); awq+gptq against AWQ and against our
  best GPTQ in the same checkpoint format (asym, contiguous groups: the AWQ format holds no g_idx);
- w3 g128: AWQ against GPTQ at gptqmodel's settings (sym, damp 0.05, group-aware order);
- wall time against gptqmodel's AWQ.

Usage:
  python benchmarks/awq.py --seeds 0 1 2                       # the g128 table (gptqmodel cannot: 576 % 128)
  python benchmarks/awq.py --seeds 0 1 2 --group-size 64 --gptqmodel-python /tmp/gqvenv/bin/python
  python benchmarks/awq.py --offgrid --seeds 0 1 2 ...          # the same on the off-grid reference model
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

CONFIGS: dict[str, list[str]] = {  # G: the group size (--group-size, 128 by default)
    "rtn-w4-asym": ["--method", "rtn", "--bits", "4", "--asym", "--format", "awq"],
    "awq-w4-asym": ["--method", "awq", "--bits", "4", "--asym"],
    "awq-w4-sym": ["--method", "awq", "--bits", "4", "--sym"],
    "awq-w4-sym-tight": ["--method", "awq", "--bits", "4", "--sym", "--sym-scale", "tight"],
    "awq+gptq-w4-asym": ["--method", "awq+gptq", "--bits", "4", "--asym", "--damp", "0.05"],
    "awq+gptq-w4-asym-mse-refit": ["--method", "awq+gptq", "--bits", "4", "--asym", "--damp", "0.05", "--mse",
                                   "--refit-scales"],
    # GPTQ at awq+gptq-w4-asym's own settings (damp 0.05, group-aware order by default): its fallback alone
    "gptq-w4-asym": ["--method", "gptq", "--bits", "4", "--asym", "--damp", "0.05", "--format", "awq"],
    # our best GPTQ that the AWQ format holds (no g_idx): group-aware order, clipping search, refit scales
    "gptq-w4-asym-gar-mse-refit": ["--method", "gptq", "--bits", "4", "--asym", "--damp", "0.05", "--group-aware-order",
                                   "--mse", "--refit-scales", "--format", "awq"],
    # 3 bits: no AWQ format; dense keeps the true zero points (GPTQ v1 would force zero >= 1)
    "awq-w3-asym": ["--method", "awq", "--bits", "3", "--asym", "--format", "dense"],
    "awq+gptq-w3-asym": ["--method", "awq+gptq", "--bits", "3", "--asym", "--damp", "0.05", "--format", "dense"],
    # GPTQ w3 at gptqmodel's settings: 57.88 over seeds 0-2 at g128 in docs/quantize.md
    "gptq-w3-sym-gar": ["--method", "gptq", "--bits", "3", "--sym", "--damp", "0.05", "--group-aware-order"],
}
DEFAULT = ["rtn-w4-asym", "awq-w4-asym", "awq+gptq-w4-asym", "awq+gptq-w4-asym-mse-refit", "gptq-w4-asym-gar-mse-refit",
           "awq-w3-asym", "awq+gptq-w3-asym", "gptq-w3-sym-gar"]
GPTQMODEL = {"awq-w4-default": ("awq", 4, "default"), "awq-w4-asym": ("awq", 4, "asym"), "awq-w3-asym": ("awq", 3, "asym")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="*", default=DEFAULT, choices=sorted(CONFIGS))
    ap.add_argument("--nsamples", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--group-size", type=int, default=128, help="gptqmodel's AWQ needs it to divide every input "
                    "width: SmolLM2's 576 takes 64, not 128.")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0], help="Calibration seeds; each run is repeated per seed.")
    ap.add_argument("--offgrid", action="store_true", help="Quantize the off-grid reference model instead of SmolLM2.")
    ap.add_argument("--work", default=str(ROOT / "build" / "bench-awq"))
    ap.add_argument("--gptqmodel-python", help="A python with gptqmodel installed: run its AWQ too.")
    ap.add_argument("--gptqmodel-configs", nargs="*", default=["awq-w4-default", "awq-w4-asym"], choices=sorted(GPTQMODEL))
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    src = source_model(work, args.offgrid)
    g = args.group_size
    tag = ("offgrid-" if args.offgrid else "") + f"g{g}-"
    rows = [{"config": f"{tag}float", "ppl": round(perplexity(str(src)), 2)}]
    print(json.dumps(rows[-1]), flush=True)
    for seed in args.seeds:
        for name in args.configs:
            out = work / f"{tag}{name}-seed{seed}"
            r = run_llmopt(str(src), str(out), [*CONFIGS[name], "--group-size", str(g)], args.nsamples, args.seqlen, seed)
            rows.append(llmopt_row(f"llmopt {name}-g{g}", seed, out, r))
            print(json.dumps(rows[-1]), flush=True)
        for name in args.gptqmodel_configs if args.gptqmodel_python else []:
            method, bits, sym = GPTQMODEL[name]
            out = work / f"{tag}gptqmodel-{name}-seed{seed}"
            if out.exists():
                shutil.rmtree(out)
            r = run_gptqmodel(args.gptqmodel_python, str(src), str(out), method, bits, sym, args.nsamples, args.seqlen,
                              seed, g)  # fmt: skip
            rows.append({"config": f"gptqmodel {name}-g{g}", "seed": seed, "ppl": round(perplexity(str(out)), 2),
                         "seconds": r["seconds"], "peak_rss_mib": r["peak_rss_mib"]})
            print(json.dumps(rows[-1]), flush=True)
    print_tables(rows, args.seeds, "awq", {"model": str(src), "nsamples": args.nsamples, "seqlen": args.seqlen,
                                           "group_size": g})


if __name__ == "__main__":
    main()
