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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.proc_status import status_kib  # noqa: E402


def write_random_model(directory: Path, layers: int, hidden: int = 1152, ffn: int = 3072, heads: int = 18, kv: int = 6) -> None:
    """A random Llama as one safetensors shard per layer (streamed: one layer in memory at a time)."""
    import torch
    from safetensors.torch import save_file

    from tests.factories import make_tokenizer

    directory.mkdir(parents=True)
    tok = make_tokenizer(directory)
    vocab = tok.get_vocab_size()
    head_dim = hidden // heads
    gen = torch.Generator().manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) / shape[-1] ** 0.5).to(torch.float16)

    weight_map: dict[str, str] = {}
    total = 0

    def shard(name: str, tensors: dict) -> None:
        nonlocal total
        save_file(tensors, str(directory / name), metadata={"format": "pt"})
        for k, v in tensors.items():
            weight_map[k] = name
            total += v.numel() * 2

    shard("embed.safetensors", {"model.embed_tokens.weight": rnd(vocab, hidden), "model.norm.weight": torch.ones(hidden, dtype=torch.float16),
                                "lm_head.weight": rnd(vocab, hidden)})
    for i in range(layers):
        p = f"model.layers.{i}."
        shard(f"layer-{i:03d}.safetensors", {
            p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.float16),
            p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.float16),
            p + "self_attn.q_proj.weight": rnd(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": rnd(kv * head_dim, hidden),
            p + "self_attn.v_proj.weight": rnd(kv * head_dim, hidden),
            p + "self_attn.o_proj.weight": rnd(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": rnd(ffn, hidden),
            p + "mlp.up_proj.weight": rnd(ffn, hidden),
            p + "mlp.down_proj.weight": rnd(hidden, ffn),
        })
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden, "intermediate_size": ffn,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv, "vocab_size": vocab,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "torch_dtype": "float16"}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", nargs="*", type=int, default=[12, 24])
    ap.add_argument("--nsamples", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=256)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gptq-memory-"))
    calib = work / "calib.txt"
    from tests.factories import CORPUS

    calib.write_text(CORPUS * 20)
    rows = []
    for layers in args.layers:
        src = work / f"random-{layers}"
        write_random_model(src, layers)
        weights = sum(f.stat().st_size for f in src.glob("*.safetensors"))
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
