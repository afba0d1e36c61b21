"""GGUF -> HF conversion: llmopt (streaming) next to transformers (load GGUF, save_pretrained).

Each converter runs in its own process so peak RSS is its own. Prints a table and a JSON line.
Usage: python benchmarks/convert_gguf_to_hf.py [MODEL.gguf] [--dtype float16]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TRANSFORMERS_SNIPPET = """
import sys, torch, transformers
path, out, dtype = sys.argv[1], sys.argv[2], getattr(torch, sys.argv[3])
from pathlib import Path
p = Path(path)
m = transformers.AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=dtype)
# save_pretrained refuses GGUF-loaded models ("not serializable"), so save the state dict directly.
from safetensors.torch import save_model
Path(out).mkdir()
save_model(m, f"{out}/model.safetensors")
m.config.save_pretrained(out)
transformers.AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name).save_pretrained(out)
"""


def run(cmd: list[str]) -> dict[str, float]:
    """Wall time and the peak RSS of the child (ru_maxrss of this one child process)."""
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True)
        _, status, rusage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - start
        if status != 0:
            log.seek(0)
            sys.exit(f"{cmd[:4]} failed:\n{log.read()[-2000:]}")
    return {"seconds": round(seconds, 2), "peak_rss_mib": round(rusage.ru_maxrss / 1024, 1)}


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from llmopt.model.embedded import smollm2_gguf

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--dtype", default="float16")
    args = ap.parse_args()
    model = args.model or str(smollm2_gguf())
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        results["llmopt"] = run([sys.executable, "-m", "llmopt.cli.app", "convert", model, "--to", "hf",
                                 "-o", f"{tmp}/llmopt", "--dtype", args.dtype])
        results["transformers"] = run([sys.executable, "-c", TRANSFORMERS_SNIPPET, model, f"{tmp}/hf", args.dtype])
        for name in results:
            folder = Path(tmp) / ("llmopt" if name == "llmopt" else "hf")
            results[name]["output_mib"] = round(sum(f.stat().st_size for f in folder.glob("*")) / 2**20, 1)
    print(f"{'converter':<14}{'seconds':>10}{'peak RSS MiB':>15}{'output MiB':>12}")
    for name, r in results.items():
        print(f"{name:<14}{r['seconds']:>10}{r['peak_rss_mib']:>15}{r['output_mib']:>12}")
    print(json.dumps({"model": Path(model).name, "dtype": args.dtype, **results}))


if __name__ == "__main__":
    main()
