"""Learned rounding's step sizes, block by block: what `--lr` and `--scale-lr` do to one block's error
on the calibration samples it was tuned on and on samples it never saw.

`llmopt quantize --method gptq --iters N` runs as usual, except that at the chosen layers each
config in `--configs` tunes the block from GPTQ's answer on the first `--train` calibration samples
(quant/tune.py's `tune_block`, called in place of the pipeline's), and the block's mean squared
error against the float block is printed as a change from GPTQ's on those samples and on the rest
(held out), with the share of codes that moved. The pipeline itself keeps GPTQ's codes, so every
layer sees the same inputs whatever the configs. This is how the default step sizes were chosen
(docs/quantize.md, "Step sizes").

Usage (the off-grid reference model, see ../shared/tools/README.md):
  python benchmarks/tune_steps.py --offgrid --layers 3 12 22 --grid "--bits 3 --group-size 128 --sym" \\
      --configs '{"lr": 0.05, "scale_lr": 0.05}' '{"lr": 0.01}' '{"lr": 0.01, "scale_lr": 0}'
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.quality import DATA, source_model  # noqa: E402
from llmopt.quant import pipeline, tune  # noqa: E402


def probe(layers: set[int], configs: list[dict], train: int):
    """A stand-in for `tune_block` that measures each config at `layers` and returns the method's answer."""

    def tune_block(block, weights, start, forward, targets, config, layer, levels=None):
        if layer in layers:
            n = targets.shape[0]
            parts = {"train": torch.arange(train), "held-out": torch.arange(train, n)}
            runs = {k: (lambda b, w, s, ix=ix: forward(b, w, ix[s])) for k, ix in parts.items()}
            base = {k: tune.whole_with(block, runs[k], targets[ix], start, 4) for k, ix in parts.items()}
            for c in configs:
                t0 = time.perf_counter()
                cfg = dataclasses.replace(config, **c)
                tuned, _ = tune.tune_block(block, weights, start, runs["train"], targets[:train], cfg, layer, levels)
                change = {k: 100 * (tune.whole_with(block, runs[k], targets[ix], tuned, 4) / base[k] - 1)
                          for k, ix in parts.items()}  # fmt: skip
                moved = sum(int((tuned[k].codes != start[k].codes).sum()) for k in start)
                share = 100 * moved / sum(start[k].codes.numel() for k in start)
                row = {"layer": layer, "iters": cfg.iters, "lr": cfg.rate, "scale_lr": cfg.scale_rate,
                       "train_pct": round(change["train"], 1), "held_out_pct": round(change["held-out"], 1),
                       "codes_moved_pct": round(share, 1), "seconds": round(time.perf_counter() - t0, 1)}  # fmt: skip
                print(json.dumps(row), flush=True)
        return dict(start), {"tune_start_mse": 0.0, "tune_mse": 0.0, "tune_kept": 0.0}

    return tune_block


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", nargs="+", type=int, required=True)
    ap.add_argument("--configs", nargs="+", required=True, help="JSON objects of TuneConfig fields (iters, lr, scale_lr)")
    ap.add_argument("--grid", default="--bits 3 --group-size 128 --sym", help="llmopt quantize's grid options")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--train", type=int, default=32, help="calibration samples tuned on; 8 more are held out")
    ap.add_argument("--seqlen", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--offgrid", action="store_true")
    ap.add_argument("--work", default=str(ROOT / "build" / "bench-tune"))
    args = ap.parse_args()
    src = source_model(Path(args.work), args.offgrid)
    pipeline.tune_block = probe(set(args.layers), [json.loads(c) for c in args.configs], args.train)
    from llmopt.cli.app import main as llmopt

    sys.argv = ["llmopt", "quantize", str(src), "-o", str(Path(args.work) / "tune-steps-out"), "--force",
                "--method", "gptq", *shlex.split(args.grid), "--format", "dense", "--nsamples", str(args.train + 8),
                "--seqlen", str(args.seqlen), "--calib", str(DATA / "valid.txt"), "--iters", str(args.iters),
                "--batch-size", str(args.batch_size), "--seed", str(args.seed)]  # fmt: skip
    llmopt()


if __name__ == "__main__":
    main()
