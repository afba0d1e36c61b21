"""`llmopt run` against the single commands it replaces: five GGUF types with an imatrix.

The recipe makes Q8_0, Q6_K, Q4_K_M, Q3_K_M and Q2_K from one source with one importance matrix,
its shared steps (the float working copy of a GGUF source, the imatrix) done once. Next to it, in
the same run and on the same threads:
- `per-job`: what five independent CI jobs of single commands do (each converts the GGUF source to
  a float folder, computes the imatrix and writes its one type): 15 commands;
- `by hand`: a careful user at one shell: one conversion, one imatrix, five converts: 7 commands.
Then a rerun of the recipe with nothing changed (every output skipped). Prints a table and a JSON line.
Usage: python benchmarks/recipe_vs_commands.py [--model M] [--chunks 32]
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

TYPES = ["Q8_0", "Q6_K", "Q4_K_M", "Q3_K_M", "Q2_K"]
DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext-2" / "valid.txt"
LLMOPT = [sys.executable, "-m", "llmopt.cli.app"]


def timed(cmds: list[list[str]]) -> float:
    start = time.perf_counter()
    for cmd in cmds:
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="a GGUF file (default: the embedded SmolLM2-135M)")
    parser.add_argument("--chunks", type=int, default=32)
    parser.add_argument("--ctx", type=int, default=512)
    args = parser.parse_args()
    if args.model is None:
        from llmopt.model.embedded import smollm2_gguf

        args.model = str(smollm2_gguf())
    work = Path(tempfile.mkdtemp(prefix="recipe-bench-"))
    try:
        outputs = "\n".join(f"  {t.lower()}: {{format: gguf, type: {t}, imatrix: true}}" for t in TYPES)
        recipe = work / "release.yaml"
        recipe.write_text(f"model: {args.model}\ncalibration: {{data: {DATA}, nsamples: {args.chunks}, seqlen: {args.ctx}}}\n"
                          f"outputs:\n{outputs}\n")  # fmt: skip
        imatrix = ["--calib", str(DATA), "--chunks", str(args.chunks), "-c", str(args.ctx)]
        rows = {"recipe": timed([[*LLMOPT, "run", str(recipe), "-o", str(work / "out")]])}
        rows["recipe rerun (all skipped)"] = timed([[*LLMOPT, "run", str(recipe), "-o", str(work / "out")]])
        per_job = []
        for t in TYPES:
            job = work / f"job-{t}"
            per_job += [[*LLMOPT, "convert", args.model, "--to", "hf", "-o", str(job / "f16")],
                        [*LLMOPT, "imatrix", str(job / "f16"), *imatrix, "-o", str(job / "imatrix.gguf")],
                        [*LLMOPT, "convert", str(job / "f16"), "--to", "gguf", "--type", t, "--imatrix",
                         str(job / "imatrix.gguf"), "-o", str(job / f"{t}.gguf")]]  # fmt: skip
        rows["per-job single commands (15)"] = timed(per_job)
        hand = work / "hand"
        by_hand = [[*LLMOPT, "convert", args.model, "--to", "hf", "-o", str(hand / "f16")],
                   [*LLMOPT, "imatrix", str(hand / "f16"), *imatrix, "-o", str(hand / "imatrix.gguf")]]  # fmt: skip
        by_hand += [[*LLMOPT, "convert", str(hand / "f16"), "--to", "gguf", "--type", t, "--imatrix", str(hand / "imatrix.gguf"),
                     "-o", str(hand / f"{t}.gguf")] for t in TYPES]  # fmt: skip
        rows["by hand: 1 conversion, 1 imatrix, 5 converts (7)"] = timed(by_hand)
        manifest = json.loads((work / "out" / "manifest.json").read_text())
        same = {t: _tensor_data(work / "out" / manifest["outputs"][t.lower()]["path"]) == _tensor_data(hand / f"{t}.gguf")
                for t in TYPES}  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{'what':52} {'wall s':>8} {'vs recipe':>10}")
    for name, seconds in rows.items():
        print(f"{name:52} {seconds:8.1f} {seconds / rows['recipe']:9.2f}x")
    print(f"every tensor of the recipe's files byte-identical to the by-hand files' (the headers differ in the "
          f"recorded command, name and imatrix file): {same}")
    print(json.dumps({"benchmark": "recipe_vs_commands", "model": args.model, "types": TYPES, "chunks": args.chunks,
                      "ctx": args.ctx, "seconds": {k: round(v, 2) for k, v in rows.items()}, "same_bytes": same}))  # fmt: skip


def _tensor_data(path: Path) -> dict[str, bytes]:
    import gguf

    return {t.name: bytes(t.data.tobytes()) for t in gguf.GGUFReader(path).tensors}


if __name__ == "__main__":
    main()
