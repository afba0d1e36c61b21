"""Fingerprints of what llmopt writes and generates on SmolLM2: run before and after a refactor.

Every output is made by the `llmopt` command itself (a subprocess, as a user runs it) from the same
paths, so the bytes can be compared across commits: the GGUF header records the command line and
the checkpoints record their source's name. It writes:

- the fp16 HF directory converted from the embedded GGUF (`make demo`'s first step);
- every GGUF mix llmopt writes, from that directory, and Q4_K_M / Q4_0 with an importance matrix
  (the imatrix file itself too);
- GPTQ checkpoints: `make demo`'s quantize command, the wikitext-calibrated one of the redesign
  issue, and variants that cross every branch of the pipeline (asymmetric, act-order, clipping
  search, refit scales, GPTAQ, float32 forward, the head, RTN, dense);
- the greedy tokens of `generate -n 64` on fp16, GPTQ and Q4_K_M.

    python benchmarks/behaviour_hashes.py --work /tmp/hashes --out before.json
    python benchmarks/behaviour_hashes.py --work /tmp/hashes --out after.json --compare before.json

Prints one line per output (sha256 of each file, or of the token list) and exits 1 when
`--compare` finds a difference. Takes about 15 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WIKITEXT = ROOT.parent / "shared" / "data" / "wikitext-2" / "valid.txt"
MIXES = ("F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L",
         "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K")
PROMPT = "The three primary colors are"


def llmopt(*args: str) -> str:
    cmd = [sys.executable, "-m", "llmopt.cli.app", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(args)}\n{proc.stderr}")
    return proc.stdout


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def path_digests(path: Path) -> dict[str, str]:
    """sha256 of a file, or of every file in a directory (by relative name)."""
    if path.is_file():
        return {path.name: file_digest(path)}
    return {str(p.relative_to(path)): file_digest(p) for p in sorted(path.rglob("*")) if p.is_file()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/llmopt-hashes"))
    ap.add_argument("--out", type=Path, help="write the fingerprints as JSON here")
    ap.add_argument("--compare", type=Path, help="fingerprints of an earlier run: exit 1 on any difference")
    ap.add_argument("--only", nargs="*", help="run only outputs whose name starts with one of these")
    args = ap.parse_args()
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    hf = work / "smollm2-135m"
    results: dict[str, dict[str, str]] = {}
    timings: dict[str, float] = {}

    def wanted(name: str) -> bool:
        return not args.only or any(name.startswith(p) for p in args.only)

    def record(name: str, make) -> None:  # noqa: ANN001
        if not wanted(name):
            return
        start = time.perf_counter()
        results[name] = make()
        timings[name] = time.perf_counter() - start
        digest = hashlib.sha256(json.dumps(results[name], sort_keys=True).encode()).hexdigest()
        print(f"{name:40s} {digest[:16]}  ({timings[name]:.1f}s)", flush=True)

    gguf_src = subprocess.run([sys.executable, "-m", "llmopt.model.embedded"], capture_output=True, text=True,
                              check=True).stdout.strip()

    def convert_hf() -> dict[str, str]:
        llmopt("convert", gguf_src, "--to", "hf", "-o", str(hf), "--force")
        return path_digests(hf)

    record("convert-hf", convert_hf)
    if not hf.is_dir():
        convert_hf()

    for mix in MIXES:
        def make_mix(mix: str = mix) -> dict[str, str]:
            out = work / f"smollm2-{mix}.gguf"
            llmopt("convert", str(hf), "--to", "gguf", "--type", mix, "-o", str(out), "--force")
            return path_digests(out)

        record(f"gguf-{mix}", make_mix)

    imatrix = work / "imatrix.gguf"

    def make_imatrix() -> dict[str, str]:
        llmopt("imatrix", str(hf), "--calib", str(WIKITEXT), "--chunks", "8", "-o", str(imatrix), "--force")
        return path_digests(imatrix)

    record("imatrix", make_imatrix)
    for mix in ("Q4_K_M", "Q4_0"):
        def make_imat_mix(mix: str = mix) -> dict[str, str]:
            if not imatrix.is_file():
                make_imatrix()
            out = work / f"smollm2-{mix}-imatrix.gguf"
            llmopt("convert", str(hf), "--to", "gguf", "--type", mix, "--imatrix", str(imatrix), "-o", str(out), "--force")
            return path_digests(out)

        record(f"gguf-{mix}-imatrix", make_imat_mix)

    quantize_runs = {
        "gptq-demo": ["--method", "gptq", "--bits", "4", "--group-size", "128", "--calib", "self",
                      "--nsamples", "32", "--seqlen", "256"],
        "gptq-wikitext": ["--method", "gptq", "--bits", "4", "--calib", str(WIKITEXT), "--nsamples", "32",
                          "--seqlen", "256"],
        "gptq-w3-asym-actorder-mse-refit-head": ["--method", "gptq", "--bits", "3", "--asym", "--act-order", "--mse",
                                                 "--refit-scales", "--quantize-head", "--calib", str(WIKITEXT),
                                                 "--nsamples", "16", "--seqlen", "128"],
        "gptq-w4-gptaq-static-f32": ["--method", "gptq", "--bits", "4", "--gptaq", "0.25", "--static-groups",
                                     "--act-order", "--calib-dtype", "float32", "--calib", str(WIKITEXT),
                                     "--nsamples", "8", "--seqlen", "128"],
        "gptq-w8-channel-dense": ["--method", "gptq", "--bits", "8", "--group-size", "-1", "--format", "dense",
                                  "--calib", str(WIKITEXT), "--nsamples", "8", "--seqlen", "128"],
        "rtn-w4-asym-head": ["--method", "rtn", "--bits", "4", "--asym", "--quantize-head"],
        "rtn-w5-tensor-dense": ["--method", "rtn", "--bits", "5", "--group-size", "0", "--format", "dense", "--mse"],
    }
    for name, opts in quantize_runs.items():
        def make_quantized(name: str = name, opts: list[str] = opts) -> dict[str, str]:
            out = work / name
            llmopt("quantize", str(hf), *opts, "-o", str(out), "--force")
            return path_digests(out)

        record(name, make_quantized)

    for name, model in (("generate-fp16", hf), ("generate-gptq", work / "gptq-demo"),
                        ("generate-Q4_K_M", work / "smollm2-Q4_K_M.gguf")):
        def make_tokens(model: Path = model) -> dict[str, str]:
            data = json.loads(llmopt("generate", str(model), "-p", PROMPT, "-n", "64", "--json"))
            return {"tokens": ",".join(map(str, data["tokens"]))}

        record(name, make_tokens)

    if args.out:
        args.out.write_text(json.dumps({"results": results, "seconds": timings}, indent=2, sort_keys=True) + "\n")
    if args.compare:
        before = json.loads(args.compare.read_text())["results"]
        differ = [n for n in results if n in before and before[n] != results[n]]
        missing = [n for n in results if n not in before]
        for n in differ:
            files = sorted(k for k in set(before[n]) | set(results[n]) if before[n].get(k) != results[n].get(k))
            print(f"DIFFERENT {n}: {', '.join(files)}")
        print(f"{len(results) - len(differ) - len(missing)} equal, {len(differ)} different, {len(missing)} not in {args.compare}")
        return 1 if differ else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
