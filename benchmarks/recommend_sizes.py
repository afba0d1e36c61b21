"""Predicted GGUF file sizes (llmopt recommend) next to the files llama.cpp's quantizer writes.

For each type: llmopt's prediction from the F16 file, its prediction from the built-in preset (no
file: metadata estimated), the naive params x nominal-bits / 8 estimate, and llama.cpp's actual file.
Prints a table and a JSON line. Usage: python benchmarks/recommend_sizes.py [MODEL.gguf] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llmopt.model.embedded import smollm2_gguf  # noqa: E402
from llmopt.plan.gguf_file import gguf_file_bytes  # noqa: E402
from llmopt.plan.models import from_preset, resolve_model  # noqa: E402
from llmopt.plan.presets import get_preset  # noqa: E402
from llmopt.plan.weights import gguf_format, weight_size  # noqa: E402
from tests.formats.gguf.llama_cpp_helpers import llama_quantize  # noqa: E402
from tests.plan.conftest import write_f16_copy  # noqa: E402

TYPES = ("F16", "Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_0", "Q3_K_M", "Q2_K")
NOMINAL_BITS = {"F16": 16, "Q8_0": 8.5, "Q6_K": 6.5625, "Q5_K_M": 5.5, "Q4_K_M": 4.5, "Q4_0": 4.5, "Q3_K_M": 3.4375,
                "Q2_K": 2.625}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", help="a GGUF file (default: the bundled SmolLM2-135M Q4_1)")
    ap.add_argument("--preset", default="smollm2-135m", help="the preset that describes the same model")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    src = Path(args.model) if args.model else smollm2_gguf()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        f16 = write_f16_copy(src, Path(tmp) / "f16.gguf")
        model = resolve_model(str(f16))
        preset = from_preset(get_preset(args.preset))
        for mix in TYPES:
            t0 = time.perf_counter()
            out = llama_quantize(f16, Path(tmp) / f"{mix}.gguf", mix, nthread=args.threads)
            seconds = time.perf_counter() - t0
            actual = out.stat().st_size
            out.unlink()
            size = weight_size(model.arch, model.tensors, gguf_format(mix))
            psize = weight_size(preset.arch, preset.tensors, gguf_format(mix))
            results.append({
                "type": mix, "llama_cpp_bytes": actual, "quantize_seconds": round(seconds, 2),
                "llmopt_bytes": gguf_file_bytes(model.tensors, size.type_counts, model.metadata_bytes, model.alignment),
                "llmopt_preset_bytes": gguf_file_bytes(preset.tensors, psize.type_counts, preset.metadata_bytes),
                "naive_bytes": int(model.parameters * NOMINAL_BITS[mix] / 8),
            })  # fmt: skip
    print(f"{'type':8}{'llama.cpp':>14}{'llmopt':>14}{'err %':>9}{'preset':>14}{'err %':>9}{'naive':>14}{'err %':>9}")
    for r in results:
        a = r["llama_cpp_bytes"]
        cells = [f"{r[k]:>14,}{100 * (r[k] - a) / a:>+9.3f}" for k in ("llmopt_bytes", "llmopt_preset_bytes", "naive_bytes")]
        print(f"{r['type']:8}{a:>14,}" + "".join(cells))
    print(json.dumps({"benchmark": "recommend_sizes", "model": str(src), "results": results}))


if __name__ == "__main__":
    main()
