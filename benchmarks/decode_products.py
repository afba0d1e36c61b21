"""One decode step's matrix products from GGUF weights kept quantized (llmopt/runtime/gguf_linear.py).

For each type and weight shape: the batch-1 product x W^T the way a decode step runs it (the
compiled product over the stored fields, gguf_gemv.py, or the tile path where a type has none),
against a float32 weight of the same shape (torch's dense product, what a dequantized model runs).
Weights are read from RAM, not cache: each timing cycles through enough copies to exceed the L3.
The blocks are llmopt's own quantization of a random matrix (a few rows, repeated).

    python benchmarks/decode_products.py --threads 2 [--types Q4_0,Q2_K] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import re
import time

import numpy as np
import torch

from llmopt.formats.gguf.blocks import pack
from llmopt.model.ggml_types import GGML_TYPES_BY_ID, GGMLQuantType
from llmopt.quant.grids import quantize
from llmopt.runtime.gguf_linear import RawGGUFLinear
from llmopt.runtime.linear import quantized_module

TYPES = ("Q4_0", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K", "F16", "IQ4_NL", "IQ4_XS",
         "IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0", "Q1_0", "Q2_0",
         "MXFP4", "NVFP4")
SHAPES = ((3072, 576), (576, 1536), (4096, 4096), (11008, 4096), (4096, 11008))  # SmolLM2's stacked gate/up, its down; 7B's
CACHE_BYTES = 64 << 20  # more than the L3 of the machines this ran on (32 MiB)


def block_rows(qtype: str, rows: int, cols: int) -> torch.Tensor:
    """[rows, bytes per row] of `qtype` blocks: 64 quantized random rows, repeated."""
    w = torch.from_numpy(np.random.default_rng(0).standard_normal((64, cols)).astype(np.float32) * 0.02)
    if qtype == "F16":
        few = w.half().view(torch.uint8).numpy()
    else:
        importance = torch.ones(cols)  # (IQ2_XXS, IQ2_XS, IQ1_S refuse to quantize without one, as llama.cpp)
        few = np.ascontiguousarray(pack(quantize(qtype, w, importance)))
    few = torch.from_numpy(few).view(torch.uint8).reshape(64, -1)
    return few.repeat(-(-rows // 64), 1)[:rows].contiguous()


def per_call_us(layers: list, x: torch.Tensor, seconds: float = 1.0) -> float:
    """Mean time of one product, cycling through `layers` so each call reads its weight from RAM."""
    for layer in layers:
        layer(x)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for layer in layers:
            layer(x)
        n += len(layers)
    return (time.perf_counter() - t0) / n * 1e6


def measure(qtype: str, rows: int, cols: int, reference: bool = False) -> dict | None:
    if cols % GGML_TYPES_BY_ID[GGMLQuantType[qtype]].block:
        return None  # rows not a whole number of blocks (K types: 256)
    data = block_rows(qtype, rows, cols)
    copies = max(2, -(-CACHE_BYTES // data.numel()))
    layers = [quantized_module(GGMLQuantType[qtype], data.clone(), None) for _ in range(copies)]
    x = torch.randn(1, cols)
    dense = [torch.nn.Linear(cols, rows, bias=False) for _ in range(max(2, -(-CACHE_BYTES // (4 * rows * cols))))]
    with torch.no_grad():
        quantized, fp32 = per_call_us(layers, x), per_call_us(dense, x)
        # gguf's numpy dequantizer per tile, then a dense product: the path every type without a module
        # of its own takes (RawGGUFLinear); slow enough that two copies keep it out of cache
        tiles = per_call_us([RawGGUFLinear(GGMLQuantType[qtype], data.clone(), None) for _ in range(2)], x) \
            if reference else None
    return {"type": qtype, "shape": f"{rows}x{cols}", "module": type(layers[0]).__name__,
            "bytes": data.numel(), "quantized_us": round(quantized, 1), "fp32_us": round(fp32, 1),
            "quantized_gb_s": round(data.numel() / quantized / 1e3, 2),
            "numpy_tiles_us": None if tiles is None else round(tiles, 1)}


def report(result: dict, path: str | None) -> None:
    """Print the results as JSON, and write them to `path` if given."""
    print(json.dumps(result, indent=1))
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--types", default=",".join(TYPES), help="GGUF types, comma-separated (default: every one)")
    ap.add_argument("--shapes", default=",".join(f"{r}x{c}" for r, c in SHAPES),
                    help="weight shapes ROWSxCOLS, comma-separated")
    ap.add_argument("--numpy-tiles", action="store_true",
                    help="also time each type through gguf's numpy dequantizer per tile (RawGGUFLinear)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    types, shapes = args.types.split(","), args.shapes.split(",")
    bad = [t for t in types if t not in TYPES]
    if bad:
        ap.error(f"type {bad[0]!r} is not one this benchmark times; have {', '.join(TYPES)}")
    bad = [s for s in shapes if not re.fullmatch(r"[1-9]\d*x[1-9]\d*", s)]
    if bad:
        ap.error(f"shape {bad[0]!r} is not ROWSxCOLS (e.g. 4096x4096)")
    torch.set_num_threads(args.threads)
    rows = []
    print(f"{'type':<8}{'W':>12}  {'module':<16}{'quantized µs':>13}{'GB/s':>7}{'fp32 µs':>10}"
          + (f"{'numpy tiles µs':>16}" if args.numpy_tiles else ""))
    for qtype in types:
        for shape in shapes:
            r = measure(qtype, *map(int, shape.split("x")), reference=args.numpy_tiles)
            if r:
                rows.append(r)
                print(f"{qtype:<8}{r['shape']:>12}  {r['module']:<16}{r['quantized_us']:>13}{r['quantized_gb_s']:>7}"
                      f"{r['fp32_us']:>10}" + (f"{r['numpy_tiles_us']:>16}" if args.numpy_tiles else ""), flush=True)
    report({"threads": args.threads, "products": rows}, args.json)


if __name__ == "__main__":
    main()
