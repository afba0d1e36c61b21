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
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.proc_status import status_kib  # noqa: E402
DATA = ROOT.parent / "shared" / "data" / "wikitext-2"

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

GPTQMODEL_SNIPPET = r"""
import sys, time, json, random
import torch
from gptqmodel import GPTQModel, QuantizeConfig
src, out, bits, calib, nsamples, seqlen, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7])
from tokenizers import Tokenizer
tok = Tokenizer.from_file(f"{src}/tokenizer.json")
ids = tok.encode(open(calib).read()).ids
g = torch.Generator().manual_seed(seed)
starts = torch.randint(0, len(ids) - seqlen + 1, (nsamples,), generator=g).tolist()
data = [{"input_ids": ids[s:s + seqlen], "attention_mask": [1] * seqlen} for s in starts]
t = time.time()
model = GPTQModel.load(src, QuantizeConfig(bits=bits, group_size=128), device="cpu")
model.quantize(data, batch_size=1)
model.save(out)
print(json.dumps({"seconds": time.time() - t}))
"""


def perplexity(model_dir: str, ctx: int = 512, windows: int = 40) -> float:
    """The project's definition (llmopt.eval.perplexity): non-overlapping windows of test.txt."""
    import torch

    from llmopt.eval.perplexity import evaluate, token_windows
    from llmopt.model import open_model
    from llmopt.model.decoder import Decoder

    with open_model(model_dir) as src:
        ids = src.tokenizer().encode((DATA / "test.txt").read_text())
        model = Decoder.from_source(src, torch.float32)
    return evaluate(model, token_windows(ids, ctx, windows)).perplexity


def run_llmopt(src: str, out: str, options: list[str], nsamples: int, seqlen: int, seed: int) -> dict:
    cmd = [sys.executable, "-m", "llmopt.cli.app", "--json", "quantize", src, "-o", out, "--force",
           "--nsamples", str(nsamples), "--seqlen", str(seqlen), "--seed", str(seed), *options]
    if "gptq" in options and "--calib" not in options:
        cmd += ["--calib", str(DATA / "valid.txt")]
    return _timed(cmd)


def _timed(cmd: list[str]) -> dict:
    """Run `cmd`; its wall time, stdout and peak RSS (VmHWM polled from /proc: the kernel's ru_maxrss
    for a child also counts the parent's RSS at fork time, and this parent holds a model)."""
    start = time.perf_counter()
    env = {**os.environ, "GPTQMODEL_CPU_WORKERS": "2"}  # gptqmodel's default (cores/2) is refused on 2 cores
    with tempfile.TemporaryFile("w+") as log, tempfile.TemporaryFile("w+") as stdout:
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=log, text=True, cwd=ROOT, env=env)
        peak_kib = 0
        while proc.poll() is None:
            peak_kib = max(peak_kib, status_kib(proc.pid).get("VmHWM", 0))
            time.sleep(0.1)
        if proc.returncode != 0:
            log.seek(0)
            sys.exit(f"{' '.join(cmd[:6])} failed:\n{log.read()[-3000:]}")
        stdout.seek(0)
        return {"seconds": round(time.perf_counter() - start, 1), "peak_rss_mib": round(peak_kib / 1024), "stdout": stdout.read()}


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
    from llmopt.model.embedded import smollm2_gguf

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    src = work / "smollm2-f16"
    if not (src / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "llmopt.cli.app", "convert", str(smollm2_gguf()), "--to", "hf", "-o", str(src),
                        "--force"], check=True, cwd=ROOT)
    rows = []
    if args.fp16:
        rows.append({"config": "fp16", "ppl": round(perplexity(str(src)), 2)})
        print(json.dumps(rows[-1]), flush=True)
    for seed in args.seeds:
        suffix = "" if seed == 0 else f"-seed{seed}"  # seed 0 keeps the plain names other benchmarks read
        for name in args.configs:
            out = work / f"{name}{suffix}"
            r = run_llmopt(str(src), str(out), CONFIGS[name], args.nsamples, args.seqlen, seed)
            result = json.loads(r.pop("stdout"))
            per_layer = [b["seconds"] for b in result["blocks"]]
            rows.append({"config": f"llmopt {name}", "seed": seed, "ppl": round(perplexity(str(out)), 2),
                         "seconds": r["seconds"], "s_per_layer": round(sum(per_layer) / len(per_layer), 2),
                         "peak_rss_mib": r["peak_rss_mib"]})
            print(json.dumps(rows[-1]), flush=True)
        for bits in args.gptqmodel_bits if args.gptqmodel_python else []:
            out = work / f"gptqmodel-w{bits}-g128{suffix}"
            cmd = [args.gptqmodel_python, "-c", GPTQMODEL_SNIPPET, str(src), str(out), str(bits), str(DATA / "valid.txt"),
                   str(args.nsamples), str(args.seqlen), str(seed)]
            if out.exists():
                shutil.rmtree(out)
            r = _timed(cmd)
            rows.append({"config": f"gptqmodel w{bits} g128 sym", "seed": seed, "ppl": round(perplexity(str(out)), 2),
                         "seconds": r["seconds"], "peak_rss_mib": r["peak_rss_mib"]})
            print(json.dumps(rows[-1]), flush=True)
    print()
    print(f"{'config':44} {'seed':>4} {'ppl':>8} {'seconds':>9} {'s/layer':>8} {'RSS MiB':>8}")
    for r in rows:
        print(f"{r['config']:44} {r.get('seed', ''):>4} {r['ppl']:8.2f} {r.get('seconds', ''):>9} {r.get('s_per_layer', ''):>8} "
              f"{r.get('peak_rss_mib', ''):>8}")
    means = seed_means(rows) if len(args.seeds) > 1 else []
    if means:
        print(f"\n{'config':44} {'seeds':>5} {'mean ppl':>9} {'min':>7} {'max':>7} {'mean s':>8}")
        for m in means:
            print(f"{m['config']:44} {m['seeds']:5d} {m['mean_ppl']:9.2f} {m['min_ppl']:7.2f} {m['max_ppl']:7.2f} {m['mean_seconds']:8.1f}")
    print(json.dumps({"benchmark": "gptq", "nsamples": args.nsamples, "seqlen": args.seqlen, "seeds": args.seeds,
                      "rows": rows, "means": means}))


def seed_means(rows: list[dict]) -> list[dict]:
    """Per config over its seeds: mean, min and max perplexity, and mean wall time."""
    by_config: dict[str, list[dict]] = {}
    for r in rows:
        if "seed" in r:
            by_config.setdefault(r["config"], []).append(r)
    return [{"config": c, "seeds": len(rs), "mean_ppl": round(sum(r["ppl"] for r in rs) / len(rs), 2),
             "min_ppl": min(r["ppl"] for r in rs), "max_ppl": max(r["ppl"] for r in rs),
             "mean_seconds": round(sum(r["seconds"] for r in rs) / len(rs), 1)} for c, rs in by_config.items()]


if __name__ == "__main__":
    main()
