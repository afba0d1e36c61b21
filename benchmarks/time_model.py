"""The footprint and time models (llmopt/plan/footprint.py) against measurement, and the time model's constants.

For each width (hidden; FFN 2.75x, rounded to 128; heads of 64, 4 query heads per KV head) a random
2-block Llama is written (benchmarks/gptq_memory.py's `write_random_model`), and each command runs
on it in a child process of its own, one at a time: imatrix, and quantize with rtn, gptq, awq and
awq+gptq (float32 calibration forward). The child reports its seconds per block (the pipeline's
own per-block times; imatrix: between its layer callbacks) and its peak RSS over the RSS it had
before the command (VmHWM - VmRSS: the working set the footprint model predicts). Then, per command,
the time model's constants are fitted by least squares over the widths: seconds per block =
FLOPs / (fraction x this machine's matmul rate) + GPTQ columns x per-column seconds.

Prints one row per (command, width) and the fitted constants as JSON. These small widths show how
the fraction climbs with width (latency and the column loop weigh more at 1-2k); the constants the
dry run projects with (footprint.EFFICIENCY) are measured at the 8B shape by benchmarks/scale.py.

Usage: python benchmarks/time_model.py [--widths 1024 1536 2048] [--nsamples 16 --seqlen 256]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

COMMANDS = ("imatrix", "rtn", "gptq", "awq", "awq+gptq")

CHILD = r"""
import json, statistics, sys, time
from benchmarks.proc_status import status_kib
from llmopt.api.imatrix import imatrix
from llmopt.api.quantize import quantize
command, src, out, calib, n, t = sys.argv[1:7]
n, t = int(n), int(t)
before = status_kib()["VmRSS"]
stamps = [time.perf_counter()]
if command == "imatrix":
    imatrix(src, calib, out, chunks=n, ctx_size=t, device="cpu", on_layer=lambda d, total: stamps.append(time.perf_counter()))
    seconds = [b - a for a, b in zip(stamps[:-1], stamps[1:])][1:] or [stamps[-1] - stamps[0]]
else:
    kw = {} if command == "rtn" else {"calib": calib, "nsamples": n, "seqlen": t, "calib_dtype": "float32"}
    r = quantize(src, out, method=command, group_size=128, device="cpu", **kw)
    seconds = [s for layer, s in r.block_seconds if layer >= 0]
print(json.dumps({"seconds_per_block": statistics.median(seconds), "peak_kib": status_kib()["VmHWM"] - before}))
"""


def shape(width: int) -> dict[str, int]:
    heads = width // 64
    return {"hidden": width, "ffn": round(2.75 * width / 128) * 128, "heads": heads, "kv_heads": max(1, heads // 4)}


def run(command: str, src: Path, work: Path, calib: Path, n: int, t: int) -> dict:
    out = work / f"out-{command.replace('+', '-')}"
    args = [sys.executable, "-c", CHILD, command, str(src), str(out), str(calib), str(n), str(t)]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def predicted(command: str, src: Path, n: int, t: int, peak: float) -> tuple[int, float, int]:
    """(footprint bytes, FLOPs, GPTQ columns) of one block as the models count them."""
    from llmopt.model import open_model
    from llmopt.plan.footprint import BlockShape, Workload, block_work, footprint

    with open_model(src) as source:
        b = BlockShape.of(source.arch)
    work = Workload("imatrix", samples=n, seqlen=t, batch=1) if command == "imatrix" else Workload("quantize", command, n, t)
    flops, columns = block_work(b, work)
    return footprint(b, work).peak, flops, columns


def fit(rows: list[dict], peak: float) -> dict[str, dict[str, float]]:
    """Per command: the fraction of the matmul rate and the per-column seconds, least squares over widths."""
    import numpy as np

    out = {}
    for command in COMMANDS:
        mine = [r for r in rows if r["command"] == command]
        if not mine:
            continue
        y = np.array([r["seconds_per_block"] for r in mine])
        x = np.array([[r["flops"] / peak] + ([r["columns"]] if r["columns"] else []) for r in mine])
        coef = np.linalg.lstsq(x, y, rcond=None)[0]
        if len(coef) > 1 and coef[1] < 0:  # no negative per-column cost: fit the rate alone
            coef = np.linalg.lstsq(x[:, :1], y, rcond=None)[0]
        out[command] = {"fraction": round(float(1 / coef[0]), 4), "per_column": float(coef[1]) if len(coef) > 1 else 0.0}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--widths", nargs="*", type=int, default=[1024, 1536, 2048])
    ap.add_argument("--commands", nargs="*", default=list(COMMANDS), choices=COMMANDS)
    ap.add_argument("--nsamples", type=int, default=16)
    ap.add_argument("--seqlen", type=int, default=256)
    args = ap.parse_args()
    from benchmarks.random_model import write_random_model
    from llmopt.model.arch import ArchSpec
    from llmopt.api.budget import matmul_flops
    from tests.factories import CORPUS, make_tokenizer

    peak = matmul_flops()
    work = Path(tempfile.mkdtemp(prefix="time-model-"))
    calib = work / "calib.txt"
    calib.write_text(CORPUS * 200)
    rows = []
    for width in args.widths:
        src = work / f"w{width}"
        src.mkdir()
        d = shape(width)
        write_random_model(src, ArchSpec.from_hf_config({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": d["hidden"],
            "intermediate_size": d["ffn"], "num_hidden_layers": 2, "num_attention_heads": d["heads"],
            "num_key_value_heads": d["kv_heads"], "vocab_size": make_tokenizer(src).get_vocab_size(),
            "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}), "float16")  # fmt: skip
        for command in args.commands:
            measured = run(command, src, work / f"w{width}", calib, args.nsamples, args.seqlen)
            need, flops, columns = predicted(command, src, args.nsamples, args.seqlen, peak)
            rows.append({"command": command, "width": width, **shape(width), "seconds_per_block": round(measured["seconds_per_block"], 3),
                         "flops": flops, "columns": columns, "peak_rss_mib": round(measured["peak_kib"] / 1024, 1),
                         "footprint_mib": round(need / 2**20, 1),
                         "footprint_over_measured": round(need / 1024 / max(measured["peak_kib"], 1), 2)})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    constants = fit(rows, peak)
    print(f"{'command':10} {'width':>6} {'s/block':>8} {'GFLOP':>8} {'peak MiB':>9} {'model MiB':>9} {'model/peak':>10}")
    for r in rows:
        print(f"{r['command']:10} {r['width']:6d} {r['seconds_per_block']:8.3f} {r['flops'] / 1e9:8.2f} "
              f"{r['peak_rss_mib']:9.1f} {r['footprint_mib']:9.1f} {r['footprint_over_measured']:10.2f}")  # fmt: skip
    print(json.dumps({"benchmark": "time_model", "matmul_gflops": round(peak / 1e9, 1), "nsamples": args.nsamples,
                      "seqlen": args.seqlen, "constants": constants, "rows": rows}))  # fmt: skip


if __name__ == "__main__":
    main()
