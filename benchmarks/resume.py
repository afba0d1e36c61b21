"""Kill -9 halfway and `--resume`: the same bytes as an uninterrupted run, at a 7B shape.

Writes a Llama-2-7B-shaped random model (hidden 4096, FFN 11008, 32 heads; `--layers` blocks, bf16,
benchmarks/random_model.py) and, per method, runs the command three times as child processes:
whole (uninterrupted), killed (SIGKILL from here once half its blocks are recorded in the progress
folder), and the same command with `--resume`. Prints wall times, the blocks the resumed run took
from the folder, the folder's size at the kill, and whether every output file's sha256 matches.

    python benchmarks/resume.py --layers 2 --json resume.json
    python benchmarks/resume.py --methods gptq --layers 4 --work /big/disk
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.scale import prepare_model, write_texts  # noqa: E402
from llmopt.plan.presets import get_preset  # noqa: E402
from safetensors import safe_open  # noqa: E402

RUNS = {
    "gptq": (["quantize", "--method", "gptq", "--bits", "4"], "gptq"),
    "awq": (["quantize", "--method", "awq", "--bits", "4"], "awq"),
    "automix": (["convert", "--to", "gguf", "--target-bpw", "4.85", "--method", "gptq", "--sensitivity-samples", "4"],
                "auto.gguf"),
}
LLMOPT = [sys.executable, "-m", "llmopt.cli.app"]


def argv(method: str, model: Path, calib: Path, nsamples: int, seqlen: int, *extra: str) -> list[str]:
    """The command line, its output named relative to the folder it runs in: a GGUF records its command
    line, so the uninterrupted and the resumed runs must differ in nothing but their folder."""
    command, *rest = RUNS[method][0]
    return [*LLMOPT, command, str(model), *rest, "--calib", str(calib), "--nsamples", str(nsamples), "--seqlen",
            str(seqlen), "-o", RUNS[method][1], "--json", *extra]  # fmt: skip


ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def run(args: list[str], cwd: Path) -> tuple[float, dict]:
    start = time.perf_counter()
    proc = subprocess.run(args, capture_output=True, text=True, cwd=cwd, env=ENV)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(args)}: exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")
    return time.perf_counter() - start, json.loads(proc.stdout)


def killed_halfway(args: list[str], cwd: Path, progress: Path, half: int) -> tuple[float, int]:
    """Start `args`, SIGKILL it once `half` blocks are recorded (the next block's inputs written after
    them); (seconds until the kill, folder bytes)."""
    start = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=cwd, env=ENV)
    while recorded(progress) < half:
        if proc.poll() is not None:
            raise SystemExit(f"{' '.join(args)}: ended (exit {proc.returncode}) before block {half - 1} was recorded")
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return time.perf_counter() - start, sum(p.stat().st_size for p in progress.iterdir() if p.is_file())


def recorded(progress: Path) -> int:
    """How many blocks the progress folder holds with the inputs of the next (0 while there is none)."""
    try:
        with safe_open(str(progress / "inputs.safetensors"), "pt") as f:
            return int((f.metadata() or {}).get("next", 0))
    except Exception:  # not written yet, or being replaced
        return 0


def digest(path: Path) -> dict[str, str]:
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {p.relative_to(path.parent).as_posix().split("/", 1)[-1]: hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", nargs="+", choices=list(RUNS), default=list(RUNS))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--nsamples", type=int, default=4)
    ap.add_argument("--seqlen", type=int, default=128)
    ap.add_argument("--work", type=Path, default=Path("/tmp/llmopt-resume"))
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    arch = replace(get_preset("llama-2-7b").arch, num_layers=a.layers)
    base = a.work.resolve() / f"7b-L{a.layers}"
    model = base / "model"
    base.mkdir(parents=True, exist_ok=True)
    prepare_model(model, arch, keep=True)
    calib, _ = write_texts(base, model, a.nsamples, a.seqlen, 1)
    rows = []
    for method in a.methods:
        name = RUNS[method][1]
        whole_dir, cut_dir = base / method / "whole", base / method / "killed"
        for d in (whole_dir, cut_dir):
            subprocess.run(["rm", "-rf", str(d)], check=True)
            d.mkdir(parents=True)
        command = argv(method, model, calib, a.nsamples, a.seqlen)
        whole_s, _ = run(command, whole_dir)
        kill_s, folder = killed_halfway(command, cut_dir, cut_dir / f".{name}.resume", a.layers // 2)
        resume_s, summary = run([*command, "--resume"], cut_dir)
        same = digest(whole_dir / name) == digest(cut_dir / name)
        rows.append({"method": method, "layers": a.layers, "whole_s": round(whole_s, 1), "killed_after_s": round(kill_s, 1),
                     "resume_s": round(resume_s, 1), "resumed_blocks": summary.get("resumed_blocks"),
                     "progress_bytes_at_kill": folder, "same_bytes": same})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    print(f"\nLlama-2-7B shape, {a.layers} layers, {a.nsamples} x {a.seqlen} calibration tokens, this machine")
    print("| method | whole s | killed after s | resume s | blocks resumed | progress folder at the kill | same bytes |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['whole_s']} | {r['killed_after_s']} | {r['resume_s']} | {r['resumed_blocks']} of "
              f"{r['layers']} | {r['progress_bytes_at_kill'] / 1e6:.0f} MB | {r['same_bytes']} |")
    if a.json:
        a.json.write_text(json.dumps({"benchmark": "resume", "shape": "llama-2-7b", "rows": rows}, indent=1) + "\n")
    if not all(r["same_bytes"] for r in rows):
        raise SystemExit("a resumed output differs from the uninterrupted one")


if __name__ == "__main__":
    main()
