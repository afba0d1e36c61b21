"""llmopt's GGUF files against llama.cpp's at the same size, scored by llama.cpp's own KL divergence.

On the off-grid reference model (SmolLM2's function, no tensor on a llama.cpp grid): llama.cpp's
files are made by its own tools (llama-imatrix over wikitext-2 valid.txt, 128 chunks of 512,
then llama-quantize --imatrix); llmopt's by `convert --method gptq|awq+gptq` on the same text
(128 samples of 512) and by the automatic mix (`--target-size` = the byte size of llama.cpp's
Q4_K_M and Q3_K_M files). Every file is scored by `llama-perplexity --kl-divergence` against the
F16 GGUF of the same model on wikitext-2 test.txt (ctx 512, 40 chunks); `--cross-check` scores them
again with `llmopt eval --ref` (the float HF model).

llama.cpp's tools are built from the source llama-cpp-python vendors (not in CI):
  pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 && tar xzf llama_cpp_python-0.3.36.tar.gz
  cd llama_cpp_python-0.3.36/vendor/llama.cpp && cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \\
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \\
    && cmake --build build -j2 --target llama-perplexity llama-imatrix llama-quantize

Usage:
  python benchmarks/gguf_quality.py --llama-bin .../llama.cpp/build/bin
  python benchmarks/gguf_quality.py --llama-bin ... --types Q4_K_M --methods gptq --automix Q4_K_M --cross-check

Every file is kept in --work and reused by the next run (delete it to remake it); the table and a
JSON line go to stdout.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.quality import DATA, source_model, timed  # noqa: E402

TYPES = ("Q4_K_M", "Q3_K_M", "Q2_K", "Q4_0")
TARGETS = {"Q4_K_M": 0.15, "Q3_K_M": 0.25, "Q2_K": 0.25, "Q4_0": 0.25}  # the margins (KLD reduction)


def run(cmd: list[str]) -> tuple[str, float]:
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        sys.exit(f"{' '.join(map(str, cmd[:6]))} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    return done.stdout + done.stderr, time.perf_counter() - start


class LlamaCpp:
    def __init__(self, bin_dir: Path, work: Path, ctx: int, chunks: int):
        self.bin, self.work, self.ctx, self.chunks = bin_dir, work, ctx, chunks
        self.base = work / f"kld-base-c{ctx}-n{chunks}.bin"

    def tool(self, name: str) -> str:
        path = self.bin / name
        if not path.is_file():
            sys.exit(f"{path}: not found; build llama.cpp's tools (see this script's docstring)")
        return str(path)

    def imatrix(self, f16: Path, out: Path) -> None:
        if not out.is_file():
            run([self.tool("llama-imatrix"), "-m", str(f16), "-f", str(DATA / "valid.txt"), "-c", "512",
                 "--chunks", "128", "-o", str(out), "-t", "2"])  # fmt: skip

    def quantize(self, f16: Path, imatrix: Path, mix: str, out: Path) -> float | None:
        if out.is_file():
            return None
        _, seconds = run([self.tool("llama-quantize"), "--imatrix", str(imatrix), str(f16), str(out), mix, "2"])
        return seconds

    def kld(self, model: Path, f16: Path) -> dict:
        """Mean KLD, perplexity and top-1 agreement ("same top p") from llama-perplexity."""
        common = ["-f", str(DATA / "test.txt"), "-c", str(self.ctx), "--chunks", str(self.chunks), "-t", "2", "-b", "512"]
        if not self.base.is_file():
            run([self.tool("llama-perplexity"), "-m", str(f16), *common, "--kl-divergence-base", str(self.base)])
        log, _ = run([self.tool("llama-perplexity"), "-m", str(model), *common, "--kl-divergence-base", str(self.base),
                      "--kl-divergence"])  # fmt: skip
        kld = re.search(r"Mean\s+KLD:\s+([-\d.]+)", log)
        ppl = re.search(r"Mean PPL\(Q\)\s*:\s+([\d.]+)", log)
        top = re.search(r"Same top p:\s+([\d.]+)", log)
        if kld is None:
            sys.exit(f"no KLD in llama-perplexity's output:\n{log[-2000:]}")
        return {"kld": float(kld.group(1)), "ppl": float(ppl.group(1)) if ppl else None,
                "top1_pct": float(top.group(1)) if top else None}  # fmt: skip


def llmopt_convert(src: Path, out: Path, *args: str) -> float | None:
    if out.is_file():
        return None
    return timed([sys.executable, "-m", "llmopt.cli.app", "convert", str(src), "--to", "gguf", "-o", str(out),
                  *args])["seconds"]  # fmt: skip


def cross_check(path: Path, ref: Path) -> float:
    from llmopt.api.evaluate import evaluate

    result, _, _ = evaluate(str(path), str(DATA / "test.txt"), ref=str(ref), ctx=512, windows=40)
    return round(result.kl_divergence, 5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bin", required=True, type=Path, help="Folder with llama-imatrix, -quantize, -perplexity.")
    ap.add_argument("--types", nargs="+", default=list(TYPES))
    ap.add_argument("--methods", nargs="+", default=["gptq", "awq+gptq"], choices=["gptq", "awq", "awq+gptq"])
    ap.add_argument("--automix", nargs="*", default=["Q4_K_M", "Q3_K_M"],
                    help="Automatic mixes at the size of llama.cpp's file of these types.")
    ap.add_argument("--automix-method", default="gptq", help="--method of the automatic mixes ('none': llama.cpp's rounding).")
    ap.add_argument("--sensitivity-samples", type=int, default=32)
    ap.add_argument("--chunks", type=int, default=40)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--cross-check", action="store_true", help="Also score every file with llmopt eval --ref.")
    ap.add_argument("--plot", type=Path, help="Write the KLD-vs-size picture of every file here (PNG).")
    ap.add_argument("--wall-time", action="store_true", help="Also time convert --type Q4_K_M --method gptq against "
                    "quantize --method gptq (a GPTQ checkpoint) on the same calibration, both made afresh.")
    ap.add_argument("--autoround", type=Path, help="auto-round's CLI (its own venv): add its GGUF files, and llmopt's "
                    "automatic mix at each one's size.")
    ap.add_argument("--autoround-formats", nargs="+", default=["gguf:q4_k_m", "gguf:q2_k_s"])
    ap.add_argument("--autoround-iters", type=int, default=0)
    ap.add_argument("--work", default=str(ROOT / "build" / "bench-gguf-quality"))
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    src = source_model(work, offgrid=True)
    llama = LlamaCpp(args.llama_bin, work, args.ctx, args.chunks)
    f16 = work / "offgrid-F16.gguf"
    llmopt_convert(src, f16, "--type", "F16")
    imatrix = work / "offgrid-imatrix-llamacpp.gguf"
    llama.imatrix(f16, imatrix)
    calib = ["--calib", str(DATA / "valid.txt"), "--nsamples", "128", "--seqlen", "512", "--seed", "0"]
    files: list[dict] = []

    def add(kind: str, mix: str, path: Path, seconds: float | None) -> None:
        row = {"file": path.name, "kind": kind, "type": mix, "bytes": path.stat().st_size, **llama.kld(path, f16)}
        if seconds is not None:
            row["seconds"] = round(seconds, 1)
        if args.cross_check:
            row["llmopt_kld"] = cross_check(path, src)
        files.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)

    sizes = {}
    for mix in dict.fromkeys([*args.types, *args.automix]):
        ref = work / f"offgrid-{mix}-llamacpp-imatrix.gguf"
        add("llama.cpp imatrix", mix, ref, llama.quantize(f16, imatrix, mix, ref))
        sizes[mix] = ref.stat().st_size
        if mix not in args.types:
            continue
        for method in args.methods:
            out = work / f"offgrid-{mix}-{method}.gguf"
            add(f"llmopt --method {method}", mix, out, llmopt_convert(src, out, "--type", mix, "--method", method, *calib))
    for mix in args.automix:
        method = [] if args.automix_method == "none" else ["--method", args.automix_method]
        tag = args.automix_method
        out = work / f"offgrid-auto-{mix}-size-{tag}.gguf"
        seconds = llmopt_convert(src, out, "--target-size", str(sizes[mix]), *method, *calib,
                                 "--sensitivity-samples", str(args.sensitivity_samples))  # fmt: skip
        add(f"llmopt automatic ({tag})", f"≤ {mix} size", out, seconds)

    for fmt in args.autoround_formats if args.autoround else []:
        tag = fmt.split(":")[1].upper()
        out_dir = work / f"autoround-{tag}-iters{args.autoround_iters}"
        seconds = None
        if not list(out_dir.glob("**/*.gguf")):
            chunks = work / "autoround-valid-chunks.json"  # the same text, in 3000-character records
            text = (DATA / "valid.txt").read_text()
            chunks.write_text(json.dumps([text[i : i + 3000] for i in range(0, len(text) - 3000, 3000)]))
            _, seconds = run([str(args.autoround), "--model_name", str(src), "--format", fmt, "--iters",
                              str(args.autoround_iters), "--nsamples", "128", "--seqlen", "512", "--dataset", str(chunks),
                              "--device", "cpu", "--output_dir", str(out_dir)])  # fmt: skip
        path = max(out_dir.glob("**/*.gguf"), key=lambda p: p.stat().st_size)
        add(f"AutoRound iters {args.autoround_iters}", tag, path, seconds)
        out = work / f"offgrid-auto-{tag}-autoround-size-gptq.gguf"
        seconds = llmopt_convert(src, out, "--target-size", str(path.stat().st_size), "--method", "gptq", *calib,
                                 "--sensitivity-samples", str(args.sensitivity_samples))  # fmt: skip
        add("llmopt automatic (gptq)", tag, out, seconds)

    wall = None
    if args.wall_time:
        import shutil

        fresh = work / "wall-time"
        shutil.rmtree(fresh, ignore_errors=True)
        fresh.mkdir()
        gguf_s = llmopt_convert(src, fresh / "q4_k_m-gptq.gguf", "--type", "Q4_K_M", "--method", "gptq", *calib)
        ckpt_s = timed([sys.executable, "-m", "llmopt.cli.app", "quantize", str(src), "--method", "gptq", "--bits", "4",
                        "--group-size", "128", *calib, "-o", str(fresh / "gptq-w4-g128")])["seconds"]  # fmt: skip
        wall = {"convert_gguf_q4_k_m_gptq_s": gguf_s, "quantize_gptq_w4_g128_s": ckpt_s,
                "ratio": round(gguf_s / ckpt_s, 2)}  # fmt: skip
        print(json.dumps(wall), file=sys.stderr, flush=True)

    reference = {r["type"]: r for r in files if r["kind"] == "llama.cpp imatrix"}
    print(f"{'file':44} {'bytes':>12} {'KLD':>9} {'vs llama.cpp':>12} {'PPL':>8} {'top1 %':>7} {'s':>7}"
          + ("  llmopt KLD" if args.cross_check else ""))  # fmt: skip
    for r in files:
        base = reference.get(r["type"].removeprefix("≤ ").removesuffix(" size")) if r["type"].startswith("≤") \
            else reference.get(r["type"])  # fmt: skip
        if r["type"].startswith("≤") and "Q3_K_M" in r["type"]:
            base = reference.get("Q4_K_M", base)  # the 3-bit-size mix is compared with llama.cpp's 4-bit file
        r["kld_change_pct"] = None if base is None or base is r else round(100 * (r["kld"] / base["kld"] - 1), 1)
        change = "" if r["kld_change_pct"] is None else f"{r['kld_change_pct']:+.1f}%"
        print(f"{r['file']:44} {r['bytes']:>12,} {r['kld']:>9.5f} {change:>12} {r['ppl'] or 0:>8.3f} "
              f"{r['top1_pct'] or 0:>7.2f} {r.get('seconds', ''):>7}" + (f"  {r['llmopt_kld']:.5f}" if args.cross_check else ""))
    if args.plot is not None:
        from llmopt.eval.pareto import Point, plot_kld_vs_size

        points = [Point(r["file"].removeprefix("offgrid-").removesuffix(".gguf"), r["bytes"], r["kld"]) for r in files]
        plot_kld_vs_size(points, args.plot, f"off-grid SmolLM2-135M: llama-perplexity KLD vs the F16 GGUF, "
                                            f"{args.chunks} x {args.ctx} tokens of wikitext-2 test")  # fmt: skip
    if wall is not None:
        print(f"wall time: convert --type Q4_K_M --method gptq {wall['convert_gguf_q4_k_m_gptq_s']} s, quantize "
              f"--method gptq (w4 g128 checkpoint) {wall['quantize_gptq_w4_g128_s']} s: {wall['ratio']}x")
    print(json.dumps({"benchmark": "gguf_quality", "ctx": args.ctx, "chunks": args.chunks, "files": files,
                      "targets": TARGETS, "wall_time": wall}))  # fmt: skip


if __name__ == "__main__":
    main()
