"""Wall time and peak memory of llmopt's commands on a Llama-3.1-8B-shaped model (random bf16 weights).

Writes a random model of the chosen shape (benchmarks/random_model.py: one safetensors shard per
layer, written a layer at a time; a byte-level BPE tokenizer exactly as wide as the embedding), a
calibration text and an eval text whose tokens are spread over the whole vocabulary, then runs each
command as its own child process (.venv/bin/llmopt, `--json`) and polls /proc every 0.2 s for the
child and its descendants: peak RSS (the child's VmHWM, or the tree's summed VmRSS if larger), and
the peaks of RssAnon (what the process allocates) and RssFile (mapped safetensors pages). A command
that fails or is killed is recorded (exit code, last stderr line) and the run goes on.

Commands (small calibration: --nsamples x --seqlen, default 8 x 256):
  imatrix  llmopt imatrix MODEL --calib calib.txt -o imatrix.gguf
  convert  llmopt convert MODEL --to gguf --type Q4_K_M --method awq+gptq --calib calib.txt -o q4km.gguf
  automix  llmopt convert MODEL --to gguf --target-size SIZE --method gptq --calib calib.txt -o auto.gguf
  awq      llmopt quantize MODEL --method awq --bits 4 --calib calib.txt -o awq/
  gptq     llmopt quantize MODEL --method gptq --bits 4 --calib calib.txt -o gptq/
  eval     llmopt eval auto.gguf q4km.gguf --ref MODEL --data eval.txt --stream (the GGUFs that exist)
  recipe   llmopt run release.yaml (an automatic-mix GGUF, a GPTQ and an AWQ output, scored on eval.txt)

Per-block seconds: the command's own block timings where its JSON has them (quantize), else the
slope between two depths of the same command (--layers 2 32), else wall / layers (an upper bound:
loading, the head and writing included). The 70B column scales that to Llama-3.1-70B by the FLOPs
of one block of each for the command's passes (the time model's `block_work`,
llmopt/plan/footprint.py), times its 80 layers; GPTQ's per-column cost is scaled as FLOPs too.

    python benchmarks/scale.py                                  # 8B shape, every command, 32 layers
    python benchmarks/scale.py --layers 2 32 --commands gptq awq --keep --work /big/disk
    python benchmarks/scale.py --layers 32 gptq=2,32 --json scale.json
    python benchmarks/scale.py --shape tiny                     # the same harness in a few seconds
The 8B shape needs about 16 GB of disk per full-depth model (and 1.5 GB per extra 2-layer one).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.proc_status import status_kib  # noqa: E402
from benchmarks.random_model import word_text, word_tokenizer, write_random_model  # noqa: E402
from llmopt.model.arch import ArchSpec  # noqa: E402
from llmopt.plan.arch_tensors import arch_tensors, parameter_count  # noqa: E402
from llmopt.plan.footprint import BlockShape, Workload, block_work  # noqa: E402
from llmopt.plan.presets import get_preset  # noqa: E402
from llmopt.api.budget import matmul_flops  # noqa: E402

LLAMA_8B = get_preset("llama-3.1-8b").arch
SHAPES = {  # Llama 3.1 8B, and its architecture (rope, GQA 4:1) at a width that runs in seconds
    "8b": LLAMA_8B,
    "tiny": replace(LLAMA_8B, hidden_size=256, intermediate_size=512, num_heads=8, num_kv_heads=2, head_dim=32,
                    num_layers=4, vocab_size=2000),
}  # fmt: skip
DTYPE = "bfloat16"  # Llama 3.1's torch_dtype
TARGET = get_preset("llama-3.1-70b").arch  # what the projection column is for
COMMANDS = ("imatrix", "convert", "automix", "awq", "gptq", "eval", "recipe")
AUTOMIX_BPW = 4.85  # the automatic mix's size: about Q4_K_M's bits per weight on Llama 3.1 8B
POLL_S = 0.2
GIB = 1 << 30


@dataclass(frozen=True)
class Job:
    """What one depth's commands read and where they write."""

    model: Path
    out: Path
    calib: Path
    eval_text: Path
    nsamples: int
    seqlen: int
    windows: int
    target_size: int
    llmopt: tuple[str, ...]
    device: str = "auto"

    def calib_flags(self) -> list[str]:
        return ["--calib", str(self.calib), "--nsamples", str(self.nsamples), "--seqlen", str(self.seqlen)]


@dataclass
class Measured:
    rc: int | None  # None: not run
    wall_s: float
    status: str = "ok"  # ok | failed | killed | skipped
    peak_rss_kib: int = 0
    rss_anon_peak_kib: int = 0
    rss_file_peak_kib: int = 0
    error: str | None = None
    result: dict | None = None


# ------------------------------------------------------------------------------------------ commands
def command_argv(name: str, job: Job) -> list[str] | str:
    """The argv of command `name` (on `job.device`), or why it cannot run (a string)."""
    argv = _command_argv(name, job)
    return argv if isinstance(argv, str) else [*argv, "--device", job.device]


def _command_argv(name: str, job: Job) -> list[str] | str:
    o, llmopt = job.out, list(job.llmopt)
    if name == "imatrix":
        return llmopt + ["imatrix", str(job.model), "--calib", str(job.calib), "--chunks", str(job.nsamples),
                         "--ctx-size", str(job.seqlen), "-o", str(o / "imatrix.gguf"), "--force", "--json"]  # fmt: skip
    if name == "convert":
        return llmopt + ["convert", str(job.model), "--to", "gguf", "--type", "Q4_K_M", "--method", "awq+gptq",
                         *job.calib_flags(), "-o", str(o / "q4km.gguf"), "--force", "--json"]  # fmt: skip
    if name == "automix":
        return llmopt + ["convert", str(job.model), "--to", "gguf", "--target-size", str(job.target_size), "--method", "gptq",
                         *job.calib_flags(), "--sensitivity-samples", str(job.nsamples), "-o", str(o / "auto.gguf"),
                         "--force", "--json"]  # fmt: skip
    if name in ("awq", "gptq"):
        return llmopt + ["quantize", str(job.model), "--method", name, "--bits", "4", *job.calib_flags(),
                         "-o", str(o / name), "--force", "--json"]  # fmt: skip
    if name == "eval":
        ggufs = [str(o / f) for f in ("auto.gguf", "q4km.gguf") if (o / f).is_file()]
        if not ggufs:
            return "no GGUF to evaluate (automix and convert failed or were not run at this depth)"
        # --stream: what the automatic choice does at full depth (8B in float32 exceeds 3/4 of a 24-48 GB
        # machine); a shallow model of the same width would be loaded whole and measure the other path
        return llmopt + ["eval", *ggufs, "--ref", str(job.model), "--data", str(job.eval_text), "--ctx", str(job.seqlen),
                         "--windows", str(job.windows), "--stream", "--json"]  # fmt: skip
    if name == "recipe":
        return llmopt + ["run", str(write_recipe(job)), "-o", str(o / "recipe"), "--force", "--json"]
    raise ValueError(name)


def write_recipe(job: Job) -> Path:
    """release.yaml: an automatic-mix GGUF, a GPTQ and an AWQ checkpoint, scored on the eval text.
    JSON is YAML, so the recipe is written with json.dumps."""
    recipe = {
        "model": str(job.model), "name": "scale",
        "calibration": {"data": str(job.calib), "nsamples": job.nsamples, "seqlen": job.seqlen, "seed": 0},
        # streamed as at full depth, where the automatic choice streams (an 8B model in float32 does
        # not fit in 3/4 of 24 GB); at a few layers it would load the reference and each output whole
        "eval": {"data": str(job.eval_text), "windows": job.windows, "ctx": job.seqlen, "stream": True},
        "outputs": {
            "auto": {"format": "gguf", "target_size": str(job.target_size), "method": "gptq", "sensitivity_samples": job.nsamples},
            "gptq": {"format": "gptq", "method": "gptq", "bits": 4},
            "awq": {"format": "awq", "method": "awq", "bits": 4},
        },
    }  # fmt: skip
    path = job.out / "release.yaml"
    path.write_text(json.dumps(recipe, indent=1) + "\n")
    return path


def calib_tokens(name: str, job: Job) -> int:
    return job.windows * job.seqlen if name == "eval" else job.nsamples * job.seqlen


# ------------------------------------------------------------------------------------------ measuring
def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (Linux /proc/PID/task/TID/children)."""
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        for task in Path(f"/proc/{p}/task").glob("*/children"):
            try:
                todo += [int(c) for c in task.read_text().split()]
            except OSError:
                pass
    return tree


def _poll(pid: int, m: Measured) -> int:
    """One reading of the tree's counters folded into `m`; returns the tree's RSS in KiB."""
    tree = [status_kib(p) for p in process_tree(pid)]
    rss = sum(s.get("VmRSS", 0) for s in tree)
    m.peak_rss_kib = max(m.peak_rss_kib, rss, *(s.get("VmHWM", 0) for s in tree))
    m.rss_anon_peak_kib = max(m.rss_anon_peak_kib, sum(s.get("RssAnon", 0) for s in tree))
    m.rss_file_peak_kib = max(m.rss_file_peak_kib, sum(s.get("RssFile", 0) for s in tree))
    return rss


def measure(argv: list[str], log: Path, max_rss_gb: float | None, timeout_s: float | None) -> Measured:
    """Run `argv` in its own session, polling its memory; killed (with its group) past the limits."""
    m = Measured(rc=0, wall_s=0.0)
    limit = None if max_rss_gb is None else max_rss_gb * GIB / 1024
    start = time.perf_counter()
    with open(log.with_suffix(".stdout"), "wb") as out, open(log.with_suffix(".stderr"), "wb") as err:
        proc = subprocess.Popen(argv, stdout=out, stderr=err, cwd=ROOT, start_new_session=True)
        killed = None
        while proc.poll() is None:
            rss = _poll(proc.pid, m)
            if killed is None:
                killed = _over(rss, limit, time.perf_counter() - start, max_rss_gb, timeout_s)
                if killed is not None:
                    os.killpg(proc.pid, signal.SIGKILL)  # the child's own session: only what it started
            time.sleep(POLL_S)
    m.wall_s, m.rc = time.perf_counter() - start, proc.returncode
    m.result = _parse_json(log.with_suffix(".stdout").read_text(errors="replace"))
    if m.rc != 0:
        m.status = "killed" if killed else "failed"
        lines = [ln for ln in log.with_suffix(".stderr").read_text(errors="replace").splitlines() if ln.strip()]
        m.error = killed or (lines[-1].strip() if lines else f"exit {m.rc}, no stderr")
    return m


def _over(rss_kib: int, limit_kib: float | None, seconds: float, max_rss_gb: float | None, timeout_s: float | None) -> str | None:
    """Why the harness stops a command now, or None."""
    if limit_kib is not None and rss_kib > limit_kib:
        return f"killed by the harness: RSS {rss_kib * 1024 / GIB:.1f} GB over --max-rss {max_rss_gb:g} GB"
    if timeout_s is not None and seconds > timeout_s:
        return f"killed by the harness after --timeout {timeout_s:g} s"
    return None


def _parse_json(stdout: str) -> dict | None:
    """The command's JSON document, or {"events": [...]} for one JSON value a line (`run --json`)."""
    try:
        return json.loads(stdout)
    except ValueError:
        pass
    events = []
    for line in stdout.splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    return {"events": events} if events else None


# ------------------------------------------------------------------------------------------ inputs
def prepare_model(directory: Path, arch: ArchSpec, keep: bool) -> float:
    """The random model of `arch` in `directory` (reused with `keep` when complete and of the same
    architecture); returns the seconds spent writing it (0 when reused)."""
    marker = directory / ".scale-arch.json"
    wanted = json.dumps({**arch.to_dict(), "dtype": DTYPE}, sort_keys=True)
    if keep and marker.is_file() and marker.read_text() == wanted:
        return 0.0
    shutil.rmtree(directory, ignore_errors=True)
    start = time.perf_counter()
    token_ids = word_tokenizer(directory, arch.vocab_size)
    write_random_model(directory, arch, DTYPE, config=token_ids)
    marker.write_text(wanted)  # last: a half-written model is never reused
    return time.perf_counter() - start


def write_texts(directory: Path, model: Path, nsamples: int, seqlen: int, windows: int) -> tuple[Path, Path]:
    """calib.txt (four times the sampled tokens, so the random windows differ) and eval.txt (the
    windows and one more), deterministic for the tokenizer in `model`."""
    calib, evaluation = directory / "calib.txt", directory / "eval.txt"
    calib.write_text(word_text(model, 4 * nsamples * seqlen, seed=1))
    evaluation.write_text(word_text(model, (windows + 1) * seqlen, seed=2))
    return calib, evaluation


def workloads(name: str, job: Job) -> list[Workload]:
    """The passes command `name` runs, as the time model (llmopt/plan/footprint.py) describes them."""
    n, t = job.nsamples, job.seqlen
    passes = {"imatrix": [Workload("imatrix", samples=n, seqlen=t)], "convert": [Workload("quantize", "awq+gptq", n, t)],
              "automix": [Workload("sensitivity", samples=n, seqlen=t), Workload("quantize", "gptq", n, t)],
              "awq": [Workload("quantize", "awq", n, t)], "gptq": [Workload("quantize", "gptq", n, t)],
              "eval": [Workload("eval", samples=job.windows, seqlen=t)]}  # fmt: skip
    passes["recipe"] = passes["automix"] + passes["gptq"] + passes["awq"] + 3 * passes["eval"]  # each output scored
    return passes[name]


def flops_ratio(works: list[Workload], arch: ArchSpec, target: ArchSpec) -> float:
    """FLOPs of one block of `target` over one block of `arch` for these passes."""
    here, there = BlockShape.of(arch), BlockShape.of(target)
    return sum(block_work(there, w)[0] for w in works) / sum(block_work(here, w)[0] for w in works)


def llmopt_argv() -> tuple[str, ...]:
    exe = ROOT / ".venv" / "bin" / "llmopt"
    return (str(exe),) if exe.is_file() else (sys.executable, "-m", "llmopt.cli.app")


# ------------------------------------------------------------------------------------------ rows
def per_block(row: dict, rows: list[dict]) -> tuple[float | None, str]:
    """Seconds per decoder block and where the number comes from (see the module's docstring)."""
    blocks = [b["seconds"] for b in (row.get("result") or {}).get("blocks", []) if b.get("layer", -1) >= 0]
    if row["status"] != "ok":
        return None, row["status"]
    if blocks:
        return sum(blocks) / len(blocks), "blocks"
    same = [r for r in rows if r["command"] == row["command"] and r["status"] == "ok"]
    if len({r["layers"] for r in same}) >= 2:
        lo, hi = min(same, key=lambda r: r["layers"]), max(same, key=lambda r: r["layers"])
        return (hi["wall_s"] - lo["wall_s"]) / (hi["layers"] - lo["layers"]), "slope"
    return row["wall_s"] / row["layers"], "wall/layers"


def finish_rows(rows: list[dict], matmul: float) -> None:
    """Per-block seconds, the 70B projection and the time model's fraction (the block's FLOPs over
    per-block seconds x this machine's float32 matmul rate `matmul`), added to every row."""
    for row in rows:
        seconds, source = per_block(row, rows)
        row["per_block_s"] = None if seconds is None else round(seconds, 6)
        row["per_block_from"] = source
        row["proj_70b_s"] = None if seconds is None else round(seconds * row["flops_ratio_70b"] * TARGET.num_layers, 1)
        row["fraction_of_matmul"] = None if not seconds else float(f"{row['block_flops'] / (seconds * matmul):.4g}")


def row_of(name: str, arch: ArchSpec, job: Job, m: Measured) -> dict:
    return {"command": name, "layers": arch.num_layers, "calib_tokens": calib_tokens(name, job), "status": m.status, "rc": m.rc,
            "wall_s": round(m.wall_s, 2), "peak_rss_gib": round(m.peak_rss_kib / 2**20, 3),
            "rss_anon_peak_gib": round(m.rss_anon_peak_kib / 2**20, 3), "rss_file_peak_gib": round(m.rss_file_peak_kib / 2**20, 3),
            "error": m.error, "result": m.result, "flops_ratio_70b": round(flops_ratio(workloads(name, job), arch, TARGET), 3),
            "block_flops": sum(block_work(BlockShape.of(arch), w)[0] for w in workloads(name, job))}  # fmt: skip


def print_table(rows: list[dict]) -> None:
    head = f"{'command':<8} {'layers':>6} {'calib tok':>9} {'status':<7} {'rc':>4} {'wall s':>8} {'peak RSS GiB':>12} {'RssAnon GiB':>11} " \
           f"{'RssFile GiB':>11} {'s/block':>8} {'from':<11} {'70B proj h':>10}  error"
    print(head)
    for r in rows:
        block = "-" if r["per_block_s"] is None else f"{r['per_block_s']:.3f}"
        proj = "-" if r["proj_70b_s"] is None else f"{r['proj_70b_s'] / 3600:.2f}"
        print(f"{r['command']:<8} {r['layers']:>6} {r['calib_tokens']:>9} {r['status']:<7} {'-' if r['rc'] is None else r['rc']:>4} {r['wall_s']:>8.1f} "
              f"{r['peak_rss_gib']:>12.3f} {r['rss_anon_peak_gib']:>11.3f} {r['rss_file_peak_gib']:>11.3f} {block:>8} "
              f"{r['per_block_from']:<11} {proj:>10}  {(r['error'] or '')[:100]}", flush=True)  # fmt: skip


# ------------------------------------------------------------------------------------------ main
def parse_layers(tokens: list[str], default: int) -> tuple[list[int], dict[str, list[int]]]:
    """`--layers 2 32 gptq=2,32`: the default depths, and each named command's own."""
    depths: list[int] = []
    per_command: dict[str, list[int]] = {}
    for token in tokens:
        name, sep, values = token.rpartition("=")
        try:
            numbers = [int(v) for v in values.split(",")]
        except ValueError:
            raise ValueError(f"--layers {token!r}: expected N, N,N or COMMAND=N[,N]") from None
        if sep and name not in COMMANDS:
            raise ValueError(f"--layers {token!r}: unknown command {name!r}; have {', '.join(COMMANDS)}")
        if any(n < 1 for n in numbers):
            raise ValueError(f"--layers {token!r}: depths must be at least 1")
        (per_command.setdefault(name, []) if sep else depths).extend(numbers)
    return sorted(set(depths or [default])), {k: sorted(set(v)) for k, v in per_command.items()}


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--commands", nargs="+", choices=COMMANDS, default=list(COMMANDS), metavar="CMD",
                    help=f"commands to run, in this order: {' '.join(COMMANDS)} (default: all)")
    ap.add_argument("--layers", nargs="+", default=[], metavar="N|CMD=N,N",
                    help="depths of the written model (default: the shape's); CMD=N,N for one command")
    ap.add_argument("--nsamples", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=256)
    ap.add_argument("--windows", type=int, default=4, help="eval windows of --seqlen tokens")
    ap.add_argument("--work", type=Path, default=Path("/tmp/llmopt-scale"), help="models, texts, outputs and logs")
    ap.add_argument("--keep", action="store_true", help="reuse a written model of the same shape, and keep it")
    ap.add_argument("--json", type=Path, help="write the rows here as JSON")
    ap.add_argument("--max-rss", type=float, metavar="GB", help="kill a command whose tree's RSS passes this (GiB)")
    ap.add_argument("--timeout", type=float, metavar="S", help="kill a command that runs longer than this")
    ap.add_argument("--device", default="auto", help="every command's --device (cuda: one block on the GPU at a time)")
    args = ap.parse_args(argv)
    if min(args.nsamples, args.seqlen, args.windows) < 1:
        ap.error("--nsamples, --seqlen and --windows must be positive")
    try:
        args.depths, args.per_command = parse_layers(args.layers, SHAPES[args.shape].num_layers)
    except ValueError as e:
        ap.error(str(e))
    return args


def run_depth(args: argparse.Namespace, arch: ArchSpec, layers: int, names: list[str]) -> list[dict]:
    """Write (or reuse) the model of this depth and run `names` on it."""
    depth = replace(arch, num_layers=layers)
    base = args.work / args.shape / f"L{layers}"
    model, out = base / "model", base / "out"
    wrote = prepare_model(model, depth, args.keep)
    print(f"# {args.shape} x {layers} layers: {parameter_count(arch_tensors(depth)) / 1e9:.3f} B parameters, "
          + (f"written in {wrote:.1f} s" if wrote else "reused (--keep)"), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    calib, evaluation = write_texts(base, model, args.nsamples, args.seqlen, args.windows)
    job = Job(model, out, calib, evaluation, args.nsamples, args.seqlen, args.windows,
              target_size=round(parameter_count(arch_tensors(depth)) * AUTOMIX_BPW / 8), llmopt=llmopt_argv(),
              device=args.device)  # fmt: skip
    rows = []
    for name in names:
        argv = command_argv(name, job)
        m = Measured(rc=None, wall_s=0.0, status="skipped", error=argv) if isinstance(argv, str) else \
            measure(argv, base / f"{name}.log", args.max_rss, args.timeout)
        rows.append({**row_of(name, depth, job, m), "argv": argv if isinstance(argv, list) else None})
    if not args.keep:
        shutil.rmtree(model)
    return rows


def main(argv: list[str] | None = None) -> dict:
    args = arguments(argv)
    arch = SHAPES[args.shape]
    names = [c for c in COMMANDS if c in args.commands]
    plan: dict[int, list[str]] = {}
    for name in names:
        for layers in args.per_command.get(name, args.depths):
            plan.setdefault(layers, []).append(name)
    rows = [row for layers in sorted(plan) for row in run_depth(args, arch, layers, plan[layers])]
    matmul = matmul_flops()  # measured here, after the commands, as `--dry-run` measures it
    finish_rows(rows, matmul)
    print_table(rows)
    report = {"benchmark": "scale", "shape": args.shape, "device": args.device, "matmul_gflops": round(matmul / 1e9, 1), "config": arch.to_hf_config(DTYPE), "nsamples": args.nsamples,
              "seqlen": args.seqlen, "windows": args.windows,
              "projection": {"model": "Llama-3.1-70B", "layers": TARGET.num_layers,
                             "formula": "per_block_s * flops_ratio_70b * layers (llmopt.plan.footprint.block_work)"},
              "rows": rows}  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
