"""Peak memory of `llmopt quantize` grows with one block, not with the model.

Random Llama models at twice SmolLM2's width (hidden 1152, FFN 3072, 18/6 heads), 12 and 24
layers, written as sharded fp16 safetensors; each is quantized with GPTQ w4 g128 in its own
process and the child's peak RSS is reported (the kernel's ru_maxrss for that child), and split by
polling /proc: anonymous memory (what the process allocates: activations, one block, Hessians) and
file-backed pages (the memory-mapped safetensors source; llmopt releases them after each block).
With one block resident, the peaks should differ by little while the models differ by ~325 MiB of
fp16 weights.

Usage: python benchmarks/gptq_memory.py [--layers 12 24] [--nsamples 8 --seqlen 256]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.proc_status import status_kib  # noqa: E402
from benchmarks.random_model import write_random_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", nargs="*", type=int, default=[12, 24])
    ap.add_argument("--nsamples", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=256)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gptq-memory-"))
    calib = work / "calib.txt"
    from llmopt.plan.presets import get_preset
    from tests.factories import CORPUS, make_tokenizer

    calib.write_text(CORPUS * 20)
    rows = []
    for layers in args.layers:
        src = work / f"random-{layers}"
        src.mkdir()
        vocab = make_tokenizer(src).get_vocab_size()
        arch = replace(get_preset("smollm2-135m").arch, hidden_size=1152, intermediate_size=3072, num_heads=18,
                       num_kv_heads=6, head_dim=64, num_layers=layers, vocab_size=vocab, tie_word_embeddings=False)
        weights = write_random_model(src, arch, "float16")
        cmd = [sys.executable, "-m", "llmopt.cli.app", "--json", "quantize", str(src), "-o", str(work / f"q-{layers}"),
               "--bits", "4", "--group-size", "128", "--calib", str(calib), "--nsamples", str(args.nsamples),
               "--seqlen", str(args.seqlen)]
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT)
        peak_anon = peak_file = 0
        while True:
            done, status, usage = os.wait4(proc.pid, os.WNOHANG)  # this child's own rusage, once it ends
            if done:
                break
            counters = status_kib(proc.pid)
            anon, file = counters.get("RssAnon", 0), counters.get("RssFile", 0)
            peak_anon, peak_file = max(peak_anon, anon), max(peak_file, file)
            time.sleep(0.05)
        if os.waitstatus_to_exitcode(status) != 0:
            sys.exit(proc.stderr.read().decode()[-3000:])
        rows.append({"layers": layers, "weights_mib": round(weights / 2**20), "peak_anon_mib": round(peak_anon / 1024),
                     "peak_file_mib": round(peak_file / 1024), "peak_rss_mib": round(usage.ru_maxrss / 1024),
                     "seconds": round(time.perf_counter() - start, 1)})
        print(json.dumps(rows[-1]), flush=True)
    if len(rows) >= 2:
        model_grow = rows[-1]["weights_mib"] - rows[0]["weights_mib"]
        print(f"weights grew {model_grow} MiB; peak anonymous memory grew {rows[-1]['peak_anon_mib'] - rows[0]['peak_anon_mib']} MiB, "
              f"peak file-backed (mapped source) {rows[-1]['peak_file_mib'] - rows[0]['peak_file_mib']} MiB, "
              f"peak RSS (both, the kernel's ru_maxrss) {rows[-1]['peak_rss_mib'] - rows[0]['peak_rss_mib']} MiB")
    print(json.dumps({"benchmark": "gptq_memory", "rows": rows}))


if __name__ == "__main__":
    main()
