"""Prefill's products from GGUF weights kept quantized: W rebuilt tile by tile (gguf_linear.tiled_linear)
and multiplied by many input rows, for several tile sizes, against the dense float32 product.

The tile size (`gguf_linear.TILE_BYTES`) trades the rebuild's per-call overhead (a dozen eager ops per
tile) and the tile's product size against cache residency. Each setting is timed `--repeats` times,
interleaved with the others, and the least time printed. Weights: llmopt's own quantization of a random
matrix (decode_products.block_rows).

    python benchmarks/prefill_tiles.py --threads 2 [--types Q4_0,IQ2_XS] [--rows 16,256] [--tiles-mb 1,4,8]
"""

from __future__ import annotations

import argparse
import time

import torch
from decode_products import block_rows, report

import llmopt.runtime.gguf_linear as gl
from llmopt.model.ggml_types import GGML_TYPES_BY_ID, GGMLQuantType
from llmopt.runtime.linear import quantized_module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--types", default="Q4_0,Q4_K,IQ2_XS")
    ap.add_argument("--shapes", default="4096x4096,11008x4096", help="weight shapes ROWSxCOLS")
    ap.add_argument("--rows", default="1,16,256", help="input rows (tokens of a prefill chunk)")
    ap.add_argument("--tiles-mb", default="1,4,8,16", help="tile sizes to compare, MiB")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tiles = [int(t) for t in args.tiles_mb.split(",")]
    out = []
    print(f"{'type':<8}{'W':>12}{'rows':>6}" + "".join(f"{f'{t} MiB':>10}" for t in tiles) + f"{'dense':>10}  (ms)")
    for qtype in args.types.split(","):
        for shape in args.shapes.split(","):
            n, k = map(int, shape.split("x"))
            if k % GGML_TYPES_BY_ID[GGMLQuantType[qtype]].block:
                continue  # rows not a whole number of blocks (K types: 256)
            layer = quantized_module(GGMLQuantType[qtype], block_rows(qtype, n, k), None)
            dense = torch.randn(n, k)
            for m in map(int, args.rows.split(",")):
                x = torch.randn(m, k)
                best = {t: float("inf") for t in (*tiles, "dense")}
                with torch.no_grad():
                    gl.tiled_linear(x, n, k, layer.rows, None)
                    for _ in range(args.repeats):
                        for t in tiles:
                            gl.TILE_BYTES = t << 20
                            t0 = time.perf_counter()
                            gl.tiled_linear(x, n, k, layer.rows, None)
                            best[t] = min(best[t], (time.perf_counter() - t0) * 1e3)
                        t0 = time.perf_counter()
                        torch.nn.functional.linear(x, dense)
                        best["dense"] = min(best["dense"], (time.perf_counter() - t0) * 1e3)
                row = {"type": qtype, "shape": shape, "rows": m, "ms": {str(t): round(v, 1) for t, v in best.items()}}
                out.append(row)
                times = "".join(f"{best[t]:>10.1f}" for t in (*tiles, "dense"))
                print(f"{qtype:<8}{shape:>12}{m:>6}{times}", flush=True)
    report({"threads": args.threads, "tiles": out}, args.json)


if __name__ == "__main__":
    main()
