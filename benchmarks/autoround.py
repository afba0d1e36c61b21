"""AutoRound (PyPI `auto-round`) and llmopt on the same model, calibration tokens and held-out text.

Each config is written by both tools from the same calibration windows (wikitext-2 valid.txt,
drawn by llmopt's `load_calibration` for the seed and handed to AutoRound as token tensors), then
one `llmopt eval` scores every output against the float model on test.txt (ctx 512, 40 windows):
KL divergence, perplexity, top-1 agreement; with each run's wall time and peak RSS, and each
output's size on disk.

Configs (AutoRound's format / llmopt's command):
  w4g128  int4 g128 sym    AutoRound `fake` (dequantized weights)   / quantize --method gptq --format dense
  w2g64   int2 g64 asym    AutoRound `fake`                          / quantize --method gptq --asym --format dense
  q4_k_m  GGUF Q4_K_M      AutoRound `gguf:q4_k_m`                   / convert --to gguf --type Q4_K_M --method gptq
  q2_k    GGUF Q2_K        AutoRound `gguf:q2_k_s`                   / convert --to gguf --type Q2_K --method gptq
          (llama.cpp's Q2_K mix in llmopt: 84.1 MiB for SmolLM2 against AutoRound's Q2_K_S, 91.6 MiB)
AutoRound runs with each of `--autoround-iters` (0: its optimized round-to-nearest; 200: its default
signed-gradient tuning), llmopt with each of `--llmopt-methods` (default gptq) and `--llmopt-iters` (0: the
method alone; N: learned rounding from its answer).

AutoRound needs its own venv beside this project's torch (it pins other transformers versions):
  python -m venv /tmp/arvenv && /tmp/arvenv/bin/pip install torch==2.13.0 auto-round gguf sentencepiece
Usage:
  python benchmarks/autoround.py --autoround-python /tmp/arvenv/bin/python --offgrid --configs w4g128 q4_k_m \\
      --autoround-iters 0 --llmopt-iters 0
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.quality import DATA, kl_scores, source_model, timed  # noqa: E402

# argv: src out bits group sym(0/1) iters format tokens.safetensors seed batch; tokens [n, t] int64
AUTOROUND_SNIPPET = r"""
import json, sys, time
import torch
from safetensors.torch import load_file
from auto_round import AutoRound
src, out, bits, group, sym, iters, fmt, tokens, seed, batch = sys.argv[1:11]
ids = load_file(tokens)["tokens"]
t = time.time()
ar = AutoRound(src, bits=int(bits), group_size=int(group), sym=sym == "1", iters=int(iters), nsamples=ids.shape[0],
               seqlen=ids.shape[1], batch_size=int(batch), dataset=[ids[i:i + 1] for i in range(ids.shape[0])],
               seed=int(seed), device_map="cpu")
ar.quantize_and_save(out, format=fmt)
print(json.dumps({"seconds": time.time() - t}))
"""

CONFIGS: dict[str, dict] = {
    "w4g128": {"bits": 4, "group": 128, "sym": True, "autoround": "fake",
               "llmopt": ["quantize", "--method", "gptq", "--bits", "4", "--group-size", "128", "--sym", "--format", "dense"]},
    "w2g64": {"bits": 2, "group": 64, "sym": False, "autoround": "fake",
              "llmopt": ["quantize", "--method", "gptq", "--bits", "2", "--group-size", "64", "--asym", "--format", "dense"]},
    "q4_k_m": {"bits": 4, "group": 32, "sym": False, "autoround": "gguf:q4_k_m",
               "llmopt": ["convert", "--to", "gguf", "--type", "Q4_K_M", "--method", "gptq"]},
    "q2_k": {"bits": 2, "group": 16, "sym": False, "autoround": "gguf:q2_k_s",
             "llmopt": ["convert", "--to", "gguf", "--type", "Q2_K", "--method", "gptq"]},
}  # fmt: skip


def calibration(src: Path, work: Path, nsamples: int, seqlen: int, seed: int) -> Path:
    """llmopt's calibration windows for `seed`, saved for AutoRound's child process."""
    from safetensors.torch import save_file

    from llmopt.calibration.samples import CalibConfig, load_calibration
    from llmopt.model import open_model

    path = work / f"calib-{nsamples}x{seqlen}-s{seed}.safetensors"
    with open_model(src) as source:
        tokens, _ = load_calibration(source, CalibConfig(str(DATA / "valid.txt"), None, nsamples, seqlen, seed))
    save_file({"tokens": tokens.contiguous()}, str(path))
    return path


def autoround_output(out: Path) -> Path:
    """The model AutoRound wrote: its GGUF file, or the HF directory (it adds a folder named after the model)."""
    ggufs = sorted(out.rglob("*.gguf"))
    if ggufs:
        return ggufs[0]
    return next(p.parent for p in sorted(out.rglob("config.json")))


def size_mib(path: Path) -> float:
    files = [path] if path.is_file() else [p for p in path.rglob("*.safetensors")]
    return round(sum(p.stat().st_size for p in files) / 2**20, 2)


def run_autoround(python: str, src: Path, out: Path, cfg: dict, iters: int, tokens: Path, seed: int, batch: int) -> dict:
    if out.exists():
        shutil.rmtree(out)
    run = timed([python, "-c", AUTOROUND_SNIPPET, str(src), str(out), str(cfg["bits"]), str(cfg["group"]),
                 "1" if cfg["sym"] else "0", str(iters), cfg["autoround"], str(tokens), str(seed), str(batch)])  # fmt: skip
    return {**run, "path": autoround_output(out)}


def run_llmopt(src: Path, out: Path, cfg: dict, iters: int, nsamples: int, seqlen: int, seed: int, batch: int,
               method: str = "gptq") -> dict:  # fmt: skip
    command, *options = cfg["llmopt"]
    options = [method if prev == "--method" else o for prev, o in zip([None, *options], options)]
    out = out.with_suffix(".gguf") if command == "convert" else out
    calibrated = method != "rtn" or iters > 0  # (round to nearest alone takes no calibration options)
    calib = ["--calib", str(DATA / "valid.txt"), "--nsamples", str(nsamples), "--seqlen", str(seqlen), "--seed", str(seed),
             "--batch-size", str(batch), "--iters", str(iters)] if calibrated else []  # fmt: skip
    cmd = [sys.executable, "-m", "llmopt.cli.app", "--json", command, str(src), *options, "-o", str(out), "--force",
           *calib]  # fmt: skip
    return {**timed(cmd), "path": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--autoround-python", required=True, help="A python with auto-round installed (see above).")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--autoround-iters", nargs="*", type=int, default=[0, 200])
    ap.add_argument("--llmopt-iters", nargs="+", type=int, default=[0, 20])
    ap.add_argument("--llmopt-methods", nargs="+", default=["gptq"], choices=["gptq", "rtn", "awq", "awq+gptq"],
                    help="llmopt's method, tuned from with --llmopt-iters > 0 (at 2 bits rtn is the better start)")
    ap.add_argument("--nsamples", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--offgrid", action="store_true")
    ap.add_argument("--work", default=str(ROOT / "build" / "bench-autoround"))
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    src = source_model(work, args.offgrid)
    tokens = calibration(src, work, args.nsamples, args.seqlen, args.seed)
    rows = []
    for name in args.configs:
        cfg = CONFIGS[name]
        for iters in args.autoround_iters:
            run = run_autoround(args.autoround_python, src, work / f"autoround-{name}-i{iters}", cfg, iters, tokens,
                                args.seed, args.batch_size)  # fmt: skip
            rows.append({"tool": "autoround", "config": name, "iters": iters, **_measured(run)})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        for method in args.llmopt_methods:
            for iters in args.llmopt_iters:
                tag = "" if method == "gptq" else f"-{method}"
                run = run_llmopt(src, work / f"llmopt-{name}{tag}-i{iters}", cfg, iters, args.nsamples, args.seqlen,
                                 args.seed, args.batch_size, method)  # fmt: skip
                rows.append({"tool": f"llmopt {method}", "config": name, "iters": iters, **_measured(run)})
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    for row, scored in zip(rows, kl_scores([r["path"] for r in rows], str(src), args.windows)):
        row.update(kl=scored["kl_divergence"], ppl=scored["perplexity"], top1=scored["top1_agreement"])
    print(f"\n{'config':8} {'tool':14} {'iters':>5} {'KL':>9} {'ppl':>9} {'top-1':>7} {'MiB':>8} {'seconds':>8} {'peak MiB':>8}")
    for r in rows:
        print(f"{r['config']:8} {r['tool']:14} {r['iters']:5d} {r['kl']:9.5f} {r['ppl']:9.3f} {r['top1']:7.4f} "
              f"{r['mib']:8.2f} {r['seconds']:8.1f} {r['peak_rss_mib']:8.0f}")  # fmt: skip
    print(json.dumps({"benchmark": "autoround", **{k: v for k, v in vars(args).items() if k != "autoround_python"},
                      "model": str(src), "rows": rows}))  # fmt: skip


def _measured(run: dict) -> dict:
    return {"path": str(run["path"]), "mib": size_mib(Path(run["path"])), "seconds": round(run["seconds"], 1),
            "peak_rss_mib": run["peak_rss_mib"]}


if __name__ == "__main__":
    main()
