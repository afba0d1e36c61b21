"""CUDA checks in one run (for a lent GPU machine): runtime decode vs transformers and vs the
memory-bandwidth roofline, GPTQ on CUDA vs CPU, GGUF grids on CUDA vs CPU bytes. Prints JSON lines.

Usage: python benchmarks/runtime_cuda.py  (needs torch with CUDA, transformers, tokenizers, gguf)
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def report(name: str, data: dict) -> None:
    print(json.dumps({"check": name, **data}), flush=True)


def decode_vs_transformers(tmp: Path) -> None:
    """A random SmolLM2-shaped model (same dims, random weights) in bf16 on CUDA: llmopt vs transformers."""
    import transformers

    from benchmarks.runtime import bench_llmopt, bench_transformers
    from llmopt.runtime.generate import Generator
    from llmopt.runtime.weights import load_model
    from tests.factories import make_tokenizer

    d = tmp / "smol-shaped"
    d.mkdir()
    make_tokenizer(d)
    cfg = transformers.LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                                   num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192,
                                   rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(d)
    ours = load_model(str(d), "bfloat16", "cuda")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).to("cuda").eval()
    ids = list(range(10, 42))
    gen = Generator(ours.model, ours.tokenizer, eos=set())
    device = torch.device("cuda")
    bench_llmopt(gen, ids, 8)
    bench_transformers(theirs, ids, 8, device)
    a = max((bench_llmopt(gen, ids, 128) for _ in range(3)), key=lambda r: r["tokens_per_s"])
    b = max((bench_transformers(theirs, ids, 128, device) for _ in range(3)), key=lambda r: r["tokens_per_s"])
    same = sum(x == y for x, y in zip(a["tokens"], b["tokens"]))
    report("decode_smollm2_shaped_bf16_cuda", {"llmopt_tok_s": round(a["tokens_per_s"], 1),
                                              "transformers_tok_s": round(b["tokens_per_s"], 1),
                                              "speedup": round(a["tokens_per_s"] / b["tokens_per_s"], 2),
                                              "llmopt_ttft_ms": round(a["ttft_ms"], 1),
                                              "tokens_equal_prefix": same})


def roofline() -> None:
    from benchmarks.runtime import roofline_8b

    for compile in (False, True):
        report(f"roofline_llama3_8b_shaped_bf16{'_compiled' if compile else ''}",
               {k: (round(v, 3) if isinstance(v, float) else v) for k, v in roofline_8b(torch.device("cuda"), compile=compile).items()})


def gptq_cuda_vs_cpu(tmp: Path) -> None:
    from llmopt.model import open_model
    from tests.factories import CORPUS, make_tiny_hf

    src = make_tiny_hf(tmp / "tiny", "llama", layers=2)
    calib = tmp / "calib.txt"
    calib.write_text(CORPUS)
    outs = {}
    for dev in ("cpu", "cuda"):
        t = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "llmopt.cli.app", "quantize", str(src), "-o", str(tmp / f"q-{dev}"),
                            "--calib", str(calib), "--nsamples", "8", "--seqlen", "64", "--group-size", "32", "--device", dev, "--json"],
                           capture_output=True, text=True, cwd=ROOT)
        outs[dev] = {"rc": r.returncode, "seconds": round(time.perf_counter() - t, 1), "err": r.stderr[-300:]}
    diffs = []
    if all(o["rc"] == 0 for o in outs.values()):
        with open_model(tmp / "q-cpu") as a, open_model(tmp / "q-cuda") as b:
            for name in a.tensors:
                diffs.append((a.load(name) - b.load(name)).abs().max().item())
    report("gptq_cuda_vs_cpu", {"runs": outs, "max_weight_diff": max(diffs) if diffs else None})
    r = subprocess.run([sys.executable, "-m", "llmopt.cli.app", "generate", str(tmp / "q-cuda"), "-p", "The quick",
                        "-n", "16", "--device", "cuda", "--json"], capture_output=True, text=True, cwd=ROOT)
    report("generate_gptq_cuda", {"rc": r.returncode, "out": (r.stdout or r.stderr)[-400:]})


def grids_cuda_vs_cpu() -> None:
    from llmopt.formats.gguf.blocks import pack
    from llmopt.quant.grids import GRIDS, quantize

    torch.manual_seed(0)
    w = torch.randn(512, 1024) * 0.05
    imp = torch.rand(1024)
    result = {}
    for name in GRIDS:
        try:
            a = pack(quantize(name, w, imp))
            qt = quantize(name, w.cuda(), imp.cuda())
            on_cuda = qt.codes.is_cuda
            b = pack(_to_cpu(qt))
            result[name] = a.tobytes() == b.tobytes() and on_cuda
        except Exception:  # report, don't stop the other checks
            result[name] = traceback.format_exc()[-700:]
    report("gguf_grids_cuda_bytes_equal_cpu", result)


def _to_cpu(qt):
    """The same QuantizedTensor with every tensor (aux included) on the CPU, for the byte packer."""
    kw = {}
    for f in dataclasses.fields(qt):
        v = getattr(qt, f.name)
        if isinstance(v, torch.Tensor):
            v = v.cpu()
        elif isinstance(v, dict):
            v = {k: t.cpu() if isinstance(t, torch.Tensor) else t for k, t in v.items()}
        kw[f.name] = v
    return type(qt)(**kw)


def main() -> None:
    report("device", {"name": torch.cuda.get_device_name(0), "torch": torch.__version__})
    only = set(sys.argv[1:])  # names of checks to run (default: all)
    with tempfile.TemporaryDirectory() as tmp:
        checks = {"grids": grids_cuda_vs_cpu, "gptq": lambda: gptq_cuda_vs_cpu(Path(tmp)),
                  "decode": lambda: decode_vs_transformers(Path(tmp)), "roofline": roofline}
        for name, check in checks.items():
            if only and name not in only:
                continue
            try:
                check()
            except Exception:
                report("failed", {"error": traceback.format_exc()[-1500:]})


if __name__ == "__main__":
    main()
