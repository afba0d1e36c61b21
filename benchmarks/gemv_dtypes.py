"""One token through `F.linear` in float32, bfloat16 and float16 (issue 44): what torch's own CPU kernels
give a decode step at each weight dtype, per shape, in µs and in weight bytes read per second.

  python benchmarks/gemv_dtypes.py --threads 2
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

# (out, in): SmolLM2-135M's up/gate and down projections and tied head, a Llama-3-8B-like MLP pair
SHAPES = [(1536, 576), (576, 1536), (49152, 576), (8192, 2048), (2048, 8192)]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def time_linear(n: int, k: int, dtype: torch.dtype, resident: int = 512 << 20) -> float:
    """Mean seconds per call of x[1, k] @ w[n, k]ᵀ, cycling through distinct weights of `resident` bytes in
    all (more than any cache holds, as a model's layers are), about 2 GB of weight reads after a warm-up."""
    count = max(2, -(-resident // (n * k * dtype.itemsize)))
    ws, x = [torch.randn(n, k).to(dtype) for _ in range(count)], torch.randn(1, k).to(dtype)
    for w in ws:
        F.linear(x, w)
    reps = max(count, int(2e9 // (n * k * dtype.itemsize)))
    start = time.perf_counter()
    for i in range(reps):
        F.linear(x, ws[i % count])
    return (time.perf_counter() - start) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    print(f"{'out x in':>12}" + "".join(f" {name + ' µs':>14} {'GB/s':>6}" for name in DTYPES))
    for n, k in SHAPES:
        row = {"out": n, "in": k}
        for name, dtype in DTYPES.items():
            seconds = time_linear(n, k, dtype)
            row[name] = {"us": round(seconds * 1e6, 1), "gb_s": round(n * k * dtype.itemsize / seconds / 1e9, 1)}
        rows.append(row)
        print(f"{f'{n}x{k}':>12}" + "".join(f" {row[d]['us']:14.1f} {row[d]['gb_s']:6.1f}" for d in DTYPES))
    print(json.dumps({"benchmark": "gemv_dtypes", "threads": args.threads, "torch": torch.__version__, "rows": rows}))


if __name__ == "__main__":
    main()
