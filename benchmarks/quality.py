"""What the quantization quality benchmarks share (gptq.py, awq.py): the source models, llmopt and
gptqmodel runs timed with their peak RSS, the issue protocol's perplexity, and the tables.

Protocol: calibrate on wikitext-2 valid.txt (128 × 512 tokens, the windows chosen by the seed, the
same for every tool); perplexity on test.txt, ctx 512, the first 40 non-overlapping windows,
scoring tokens 1..511 of each (llmopt.eval.perplexity, float32).

gptqmodel needs torch >= 2.14 by its metadata, so it lives in its own venv that reuses this
project's torch (see benchmarks/gptq_interop.py for the recipe).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.proc_status import status_kib  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "wikitext-2"
OFFGRID_TOOL = ROOT.parent / "shared" / "tools" / "make_offgrid_reference.py"

# gptqmodel with the windows llmopt's `calibration_tokens` draws for the same seed (checked equal
# with torch.equal for seeds 0, 1, 2), quantized and saved; argv: src out method bits sym calib n len seed group
GPTQMODEL_SNIPPET = r"""
import sys, time, json
import torch
from gptqmodel import GPTQModel, QuantizeConfig
src, out, method, bits, sym, calib = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], sys.argv[6]
nsamples, seqlen, seed, group = int(sys.argv[7]), int(sys.argv[8]), int(sys.argv[9]), int(sys.argv[10])
from tokenizers import Tokenizer
tok = Tokenizer.from_file(f"{src}/tokenizer.json")
ids = tok.encode(open(calib).read()).ids
g = torch.Generator().manual_seed(seed)
starts = torch.randint(0, len(ids) - seqlen + 1, (nsamples,), generator=g).tolist()
data = [{"input_ids": ids[s:s + seqlen], "attention_mask": [1] * seqlen} for s in starts]
options = {"bits": bits, "group_size": group}
if method != "gptq":
    options["quant_method"] = method
if sym != "default":
    options["sym"] = sym == "sym"
t = time.time()
model = GPTQModel.load(src, QuantizeConfig(**options), device="cpu")
model.quantize(data, batch_size=1)
model.save(out)
print(json.dumps({"seconds": time.time() - t}))
"""


def source_model(work: Path, offgrid: bool = False) -> Path:
    """SmolLM2 as an fp16 HF directory (converted by llmopt), or the off-grid reference model made
    from it by ../shared/tools/make_offgrid_reference.py."""
    from llmopt.model.embedded import smollm2_gguf

    src = work / "smollm2-f16"
    if not (src / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "llmopt.cli.app", "convert", str(smollm2_gguf()), "--to", "hf", "-o",
                        str(src), "--force"], check=True, cwd=ROOT)  # fmt: skip
    if not offgrid:
        return src
    out = work / "smollm2-offgrid"
    if not (out / "config.json").is_file():
        subprocess.run([sys.executable, str(OFFGRID_TOOL), str(src), str(out), "--text", str(DATA / "valid.txt")],
                       check=True, cwd=ROOT)  # fmt: skip
    return out


def perplexity(model_dir: str, ctx: int = 512, windows: int = 40) -> float:
    """The project's definition (llmopt.eval.perplexity): non-overlapping windows of test.txt."""
    import torch

    from llmopt.eval.perplexity import evaluate, token_windows
    from llmopt.model import open_model
    from llmopt.model.decoder import Decoder

    with open_model(model_dir) as src:
        ids = src.tokenizer().encode((DATA / "test.txt").read_text())
        model = Decoder.from_source(src, torch.float32)
    return evaluate(model, token_windows(ids, ctx, windows)).perplexity


def run_llmopt(src: str, out: str, options: list[str], nsamples: int, seqlen: int, seed: int) -> dict:
    """`llmopt quantize` in a child process: wall time, peak RSS and its --json output."""
    cmd = [sys.executable, "-m", "llmopt.cli.app", "--json", "quantize", src, "-o", out, "--force",
           "--nsamples", str(nsamples), "--seqlen", str(seqlen), "--seed", str(seed), *options]
    if "rtn" not in options and "--calib" not in options:
        cmd += ["--calib", str(DATA / "valid.txt")]
    return timed(cmd)


def llmopt_row(config: str, seed: int, out: Path, run: dict) -> dict:
    """One table row for an llmopt run: perplexity of its output, wall time, mean seconds per layer, peak RSS."""
    summary = json.loads(run["stdout"])
    per_layer = [b["seconds"] for b in summary["blocks"]]
    row = {"config": config, "seed": seed, "ppl": round(perplexity(str(out)), 2), "seconds": run["seconds"],
           "s_per_layer": round(sum(per_layer) / len(per_layer), 2), "peak_rss_mib": run["peak_rss_mib"]}
    kept = {r["name"].rsplit(".", 2)[0]: r["fallback_kept"] for r in summary["layers"] if "fallback_kept" in r}
    if kept:  # a method with a fallback (awq+gptq): the blocks that kept it (GPTQ alone)
        row["fallback_blocks"] = f"{sum(kept.values())}/{len(kept)}"
    return row


def run_gptqmodel(python: str, src: str, out: str, method: str, bits: int, sym: str, nsamples: int, seqlen: int,
                  seed: int, group_size: int = 128) -> dict:  # fmt: skip
    """gptqmodel's `method` ("gptq" or "awq"); `sym` "sym", "asym" or "default" (its own)."""
    return timed([python, "-c", GPTQMODEL_SNIPPET, src, out, method, str(bits), sym, str(DATA / "valid.txt"),
                  str(nsamples), str(seqlen), str(seed), str(group_size)])  # fmt: skip


def kl_scores(models: list[str], ref: str, windows: int = 40, data: Path | None = None) -> list[dict]:
    """One `llmopt eval` of every model against `ref` on `data` (test.txt unless given; ctx 512; the
    reference's forward shared by all): each model's KL divergence, perplexity and top-1 agreement, in order."""
    cmd = [sys.executable, "-m", "llmopt.cli.app", "--json", "eval", *models, "--ref", ref, "--data",
           str(data or DATA / "test.txt"), "--ctx", "512", "--windows", str(windows)]
    out = json.loads(subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=True).stdout)
    return out["models"] if "models" in out else [out]  # one model: its result alone


def timed(cmd: list[str]) -> dict:
    """Run `cmd`; its wall time, stdout and peak RSS (VmHWM polled from /proc: the kernel's ru_maxrss
    for a child also counts the parent's RSS at fork time, and this parent holds a model)."""
    start = time.perf_counter()
    env = {**os.environ, "GPTQMODEL_CPU_WORKERS": "2"}  # gptqmodel's default (cores/2) is refused on 2 cores
    with tempfile.TemporaryFile("w+") as log, tempfile.TemporaryFile("w+") as stdout:
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=log, text=True, cwd=ROOT, env=env)
        peak_kib = 0
        while proc.poll() is None:
            peak_kib = max(peak_kib, status_kib(proc.pid).get("VmHWM", 0))
            time.sleep(0.1)
        if proc.returncode != 0:
            log.seek(0)
            sys.exit(f"{' '.join(cmd[:6])} failed:\n{log.read()[-3000:]}")
        stdout.seek(0)
        return {"seconds": round(time.perf_counter() - start, 1), "peak_rss_mib": round(peak_kib / 1024), "stdout": stdout.read()}


def seed_means(rows: list[dict]) -> list[dict]:
    """Per config over its seeds: mean, min and max perplexity, and mean wall time."""
    by_config: dict[str, list[dict]] = {}
    for r in rows:
        if "seed" in r:
            by_config.setdefault(r["config"], []).append(r)
    return [{"config": c, "seeds": len(rs), "mean_ppl": round(sum(r["ppl"] for r in rs) / len(rs), 2),
             "min_ppl": min(r["ppl"] for r in rs), "max_ppl": max(r["ppl"] for r in rs),
             "mean_seconds": round(sum(r["seconds"] for r in rs) / len(rs), 1)} for c, rs in by_config.items()]


def print_tables(rows: list[dict], seeds: list[int], name: str, extra: dict) -> None:
    """The run table, the per-config means over seeds, and one JSON line with everything."""
    print()
    print(f"{'config':48} {'seed':>4} {'ppl':>8} {'seconds':>9} {'s/layer':>8} {'RSS MiB':>8} {'fallback':>8}")
    for r in rows:
        print(f"{r['config']:48} {r.get('seed', ''):>4} {r['ppl']:8.2f} {r.get('seconds', ''):>9} "
              f"{r.get('s_per_layer', ''):>8} {r.get('peak_rss_mib', ''):>8} {r.get('fallback_blocks', ''):>8}")  # fmt: skip
    means = seed_means(rows) if len(seeds) > 1 else []
    if means:
        print(f"\n{'config':48} {'seeds':>5} {'mean ppl':>9} {'min':>7} {'max':>7} {'mean s':>8}")
        for m in means:
            print(f"{m['config']:48} {m['seeds']:5d} {m['mean_ppl']:9.2f} {m['min_ppl']:7.2f} {m['max_ppl']:7.2f} "
                  f"{m['mean_seconds']:8.1f}")  # fmt: skip
    print(json.dumps({"benchmark": name, "seeds": seeds, **extra, "rows": rows, "means": means}))
