"""Learned rounding at the shapes people run: one block of a real architecture (random weights), its
peak memory and seconds measured, next to what `--dry-run` predicts for the same command.

A random model of the preset's shape with `--layers` blocks and a small vocabulary (the block is
what tuning holds; the embedding and head are the other steps' business) is written as fp16
safetensors, then `llmopt quantize --method rtn --iters N` runs in a child process while its
anonymous RSS is polled. The dry run of the same command gives the footprint model's peak and the
time model's seconds per block (quant/tune.py's cost: `plan.footprint.tune_flops` at
`EFFICIENCY["tune"]` of this machine's matmul rate, which this script also prints).

Usage: python benchmarks/tune_memory.py --preset llama-3.1-8b --iters 2 --nsamples 4 --seqlen 256 --batch-size 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.proc_status import status_kib  # noqa: E402
from benchmarks.random_model import write_random_model  # noqa: E402


def run(cmd: list[str]) -> tuple[dict, int, float]:
    """`cmd`'s --json output, its peak anonymous RSS (KiB) and wall seconds."""
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, cwd=ROOT)
        peak = 0
        while proc.poll() is None:
            peak = max(peak, status_kib(proc.pid).get("RssAnon", 0))
            time.sleep(0.05)
        err.seek(0)
        out.seek(0)
        if proc.returncode != 0:
            sys.exit(err.read()[-3000:])
        return json.loads(out.read()), peak, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama-3.1-8b")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--nsamples", type=int, default=4)
    ap.add_argument("--seqlen", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=2)
    args = ap.parse_args()
    from llmopt.api.budget import matmul_flops
    from llmopt.plan.presets import get_preset
    from tests.factories import CORPUS, make_tokenizer

    work = Path(tempfile.mkdtemp(prefix="tune-memory-"))
    calib = work / "calib.txt"
    calib.write_text(CORPUS * 50)
    src = work / "random"
    src.mkdir()
    vocab = make_tokenizer(src).get_vocab_size()
    arch = replace(get_preset(args.preset).arch, num_layers=args.layers, vocab_size=vocab, tie_word_embeddings=False)
    write_random_model(src, arch, "float16")
    base = [sys.executable, "-m", "llmopt.cli.app", "--json", "quantize", str(src), "--method", "rtn", "--bits", "4",
            "--iters", str(args.iters), "--calib", str(calib), "--nsamples", str(args.nsamples), "--seqlen",
            str(args.seqlen), "--batch-size", str(args.batch_size)]  # fmt: skip
    plan, _, _ = run([*base, "--dry-run", "-o", str(work / "plan")])
    result, peak_kib, seconds = run([*base, "-o", str(work / "q")])
    block = plan["passes"][-1]
    per_block = [b["seconds"] for b in result["blocks"]]
    row = {"preset": args.preset, "layers": args.layers, "iters": args.iters, "samples": args.nsamples,
           "seqlen": args.seqlen, "batch": args.batch_size, "measured_peak_anon_mib": round(peak_kib / 1024),
           "modeled_block_mib": round(block["footprint"]["block_bytes"] / 2**20),
           "modeled_peak_mib": round(block["footprint"]["peak_bytes"] / 2**20), "measured_s_per_block": round(max(per_block), 1),
           "modeled_s_per_block": None if block["seconds_per_block"] is None else round(block["seconds_per_block"], 1),
           "wall_s": round(seconds, 1), "matmul_gflops": round(matmul_flops() / 1e9, 1)}  # fmt: skip
    for k, v in row.items():
        print(f"{k:24} {v}")
    print(json.dumps({"benchmark": "tune_memory", **row}))


if __name__ == "__main__":
    main()
