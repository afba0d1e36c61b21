"""CUDA checks in one run (for a lent GPU machine), correctness first, then speed. Prints JSON lines.

- grids: GGUF grids quantized on CUDA give the CPU's bytes.
- gptq: `llmopt quantize` GPTQ on CUDA vs CPU; generating from it on CUDA.
- smollm2: SmolLM2 greedy on CUDA equals the CPU for 64 tokens (float32); its Q4_0, Q8_0 and Q4_K_M files
  kept quantized on CUDA (float32: the fields' products, compiled for the GPU; bfloat16: the int4 kernel for
  the Q4 types) against the CPU's dequantized model: logits, greedy tokens, decode tok/s; a GPTQ w4 g128
  checkpoint packed (tinygemm) against dequantized.
- decode: a SmolLM2-shaped bf16 model, llmopt vs transformers.
- roofline: Llama-3-8B-shaped random bf16 weights, eager and `--compile`, against the HBM roofline.
- q4km, gptq8b: the same shape as Q4_K_M GGUF weights kept quantized and as GPTQ int4 g128, bytes read
  per token over the quantized bytes (compiled; `q4km_eager`, `gptq8b_eager` eager).

Usage: python benchmarks/runtime_cuda.py [CHECK ...] [--smollm2 FILE.gguf]  (default: all but the eager
quantized ones; needs torch with CUDA, transformers, tokenizers, gguf)

On this project's lent H200 (15 minutes of device time a task, 64 MiB sent a call, nothing installable
there): `bash benchmarks/device_prepare.sh` here first; it says what to run there, in two calls.
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


def _greedy(model, ids: list[int], tokens: int) -> tuple[list[int], float]:
    from benchmarks.runtime import bench_llmopt
    from llmopt.runtime.generate import Generator

    gen = Generator(model, None, eos=set())
    bench_llmopt(gen, ids, 4)  # warm-up: the products compile
    r = bench_llmopt(gen, ids, tokens)
    return r["tokens"], r["tokens_per_s"]


def _logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids], device=next(model.parameters()).device)).float().cpu()


def _compare(ref_logits: torch.Tensor, ref_tokens: list[int], logits: torch.Tensor, tokens: list[int]) -> dict:
    same = next((i for i, (a, b) in enumerate(zip(ref_tokens, tokens)) if a != b), len(ref_tokens))
    return {"logits_max_rel_err": float((logits - ref_logits).abs().max() / ref_logits.abs().max()),
            "greedy_tokens_equal_prefix": same, "of": len(ref_tokens)}


def _module_kinds(model) -> dict:
    from collections import Counter

    return dict(Counter(type(m).__name__ for m in model.modules() if hasattr(m, "out_features")))


def smollm2_cuda_vs_cpu(tmp: Path, base: Path, device: str = "cuda") -> None:
    from benchmarks.runtime import PROMPT
    from benchmarks.runtime_quantized import held_bytes, write_mix
    from llmopt.runtime.weights import load_model

    torch.backends.cuda.matmul.allow_tf32 = False  # float32 products as float32 (the CPU's)
    torch.backends.cudnn.allow_tf32 = False
    cpu = load_model(str(base), "float32", "cpu", quantized=False)
    ids = cpu.tokenizer.encode(PROMPT)
    tokens, _ = _greedy(cpu.model, ids, 64)
    gpu = load_model(str(base), "float32", device, quantized=False)
    gpu_tokens, tok_s = _greedy(gpu.model, ids, 64)
    row = _compare(_logits(cpu.model, ids), tokens, _logits(gpu.model, ids), gpu_tokens)
    report(f"smollm2_fp32_{device}_vs_cpu", {**row, "tok_s": round(tok_s, 1)})
    del gpu
    for mix in ("Q4_0", "Q8_0", "Q4_K_M"):
        path = write_mix(base, mix, tmp / f"smollm2-{mix}.gguf")
        ref = load_model(str(path), "float32", "cpu", quantized=False).model
        ref_logits, ref_tokens = _logits(ref, ids), _greedy(ref, ids, 64)[0]
        for dtype in ("float32", "bfloat16"):
            try:
                kept = load_model(str(path), dtype, device, quantized=True).model
                got, tok_s = _greedy(kept, ids, 64)
                logits = _logits(kept, ids)
                row = {"vs_cpu_float32": _compare(ref_logits, ref_tokens, logits, got), "tok_s": round(tok_s, 1),
                       "held_mib": round(held_bytes(kept) / 2**20, 1), "modules": _module_kinds(kept)}
                dense = load_model(str(path), dtype, device, quantized=False).model
                dense_tokens, dense_tok_s = _greedy(dense, ids, 64)
                row["dequantized_tok_s"] = round(dense_tok_s, 1)
                row["vs_dequantized_same_device_dtype"] = _compare(_logits(dense, ids), dense_tokens, logits, got)
                report(f"smollm2_{mix}_kept_quantized_{device}_{dtype}", row)
                del kept, dense
            except Exception:  # report, go on with the others
                report(f"smollm2_{mix}_kept_quantized_{device}_{dtype}", {"error": traceback.format_exc()[-1500:]})
    for bits, dtype in ((4, "bfloat16"), (3, "float32")):  # tinygemm; bit planes (exact float math)
        gptq = tmp / f"smollm2-gptq-w{bits}g128"
        r = subprocess.run([sys.executable, "-m", "llmopt.cli.app", "quantize", str(base), "-o", str(gptq), "--method",
                            "rtn", "--bits", str(bits), "--group-size", "128", "--format", "gptq", "--json"],
                           capture_output=True, text=True, cwd=ROOT)
        name = f"smollm2_gptq_w{bits}g128_{device}_packed_vs_dequantized_{dtype}"
        if r.returncode:
            report(name, {"quantize_error": r.stderr[-800:]})
            continue
        try:
            dense = load_model(str(gptq), dtype, device, quantized=False).model
            packed = load_model(str(gptq), dtype, device).model
            ref_tokens, dense_tok_s = _greedy(dense, ids, 64)
            got, tok_s = _greedy(packed, ids, 64)
            report(name, {**_compare(_logits(dense, ids), ref_tokens, _logits(packed, ids), got),
                          "packed_tok_s": round(tok_s, 1), "dequantized_tok_s": round(dense_tok_s, 1),
                          "modules": _module_kinds(packed), "held_mib": round(held_bytes(packed) / 2**20, 1)})
        except Exception:
            report(name, {"error": traceback.format_exc()[-1500:]})


def quantized_8b(kind: str, compile: bool, device: torch.device = torch.device("cuda"), arch=None) -> dict:
    """Llama-3-8B-shaped decode with weights kept quantized: `Q4_K_M` (each tensor the type llama.cpp's mix
    gives it; bfloat16 model, so Q4_K takes the int4 kernel and Q6_K the fields' product) or `GPTQ` (int4
    g128, tinygemm). Bytes per token: every linear's held bytes. (`device`, `arch`: a small CPU run checks the
    script before a GPU's minutes are spent on it.)"""
    from benchmarks.decode_products import block_rows
    from benchmarks.runtime import decode_roofline, llama3_8b_arch
    from benchmarks.runtime_quantized import RandomLlamaSource, held_bytes
    from llmopt.formats.gguf.writer import plan_gguf
    from llmopt.model.decoder import Decoder, Rotary, hf_to_param_name
    from llmopt.model.ggml_types import GGMLQuantType
    from llmopt.runtime.gguf_linear import stacked
    from llmopt.runtime.int4 import PackedInt4Linear
    from llmopt.runtime.linear import quantized_module
    from llmopt.runtime.row_major import fuse_shared_inputs

    arch = arch or llama3_8b_arch()
    with torch.device("meta"):
        model = Decoder(arch)
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    types = {}
    if kind == "Q4_K_M":
        src = RandomLlamaSource(arch.hidden_size, arch.num_layers, arch.intermediate_size, arch.vocab_size,
                                arch.num_heads, arch.num_kv_heads)
        types = {hf_to_param_name(t.hf_name).removesuffix(".weight"): GGMLQuantType[t.type_name]
                 for t in plan_gguf(src, "Q4_K_M").tensors if t.hf_name}
    for path in linears:
        out_f, in_f = model.get_submodule(path).weight.shape
        if kind == "GPTQ":
            g = torch.Generator(device=device).manual_seed(len(path))
            codes = torch.randint(0, 16, (out_f, in_f), device=device, generator=g, dtype=torch.uint8)
            scales = torch.rand(out_f, in_f // 128, device=device, generator=g) * 0.01
            module = PackedInt4Linear(codes, scales, -8 * scales, 128, None)
        else:
            blocks = block_rows(types[path].name, out_f, in_f)  # (speed: only the bytes' amount matters)
            module = quantized_module(types[path], blocks, None, torch.bfloat16, device)
        model.set_submodule(path, module)
    floats = {n: (torch.randn(p.shape, device=device) * 0.02 if p.dim() == 2 else torch.ones(p.shape, device=device))
              for n, p in model.named_parameters() if p.is_meta}
    model.load_state_dict({n: t.to(torch.bfloat16) for n, t in floats.items()}, strict=False, assign=True)
    fuse_shared_inputs(model, stacked)
    model.rotary = Rotary(arch).to(device)
    model.eval()
    weight_bytes = held_bytes(model) - model.embed_tokens.weight.nbytes
    row = decode_roofline(model, device, weight_bytes, compile=compile)
    return {**row, "modules": _module_kinds(model)}


def _rounded(row: dict) -> dict:
    return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}


def roofline() -> None:
    from benchmarks.runtime import roofline_8b

    for compile in (False, True):
        report(f"roofline_llama3_8b_shaped_bf16{'_compiled' if compile else ''}",
               _rounded(roofline_8b(torch.device("cuda"), compile=compile)))


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
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checks", nargs="*", help="names of checks to run (default: all but the *_eager ones)")
    ap.add_argument("--smollm2", type=Path, help="SmolLM2's GGUF (default: the embedded model's package)")
    args = ap.parse_args()
    report("device", {"name": torch.cuda.get_device_name(0), "torch": torch.__version__})
    only = set(args.checks)
    with tempfile.TemporaryDirectory() as tmp:
        def smollm2() -> None:
            from llmopt.model.embedded import smollm2_gguf

            smollm2_cuda_vs_cpu(Path(tmp), args.smollm2 or smollm2_gguf())

        checks = {"grids": grids_cuda_vs_cpu, "gptq": lambda: gptq_cuda_vs_cpu(Path(tmp)), "smollm2": smollm2,
                  "decode": lambda: decode_vs_transformers(Path(tmp)), "roofline": roofline}
        for kind, name in (("Q4_K_M", "q4km"), ("GPTQ", "gptq8b")):
            for compile, suffix in ((True, ""), (False, "_eager")):
                checks[name + suffix] = lambda kind=kind, compile=compile, name=name + suffix: report(
                    f"roofline_llama3_8b_shaped_{name}", _rounded(quantized_8b(kind, compile)))
        for name, check in checks.items():
            if (only and name not in only) or (not only and name.endswith("_eager")):
                continue
            t0 = time.perf_counter()
            try:
                check()
            except Exception:
                report("failed", {"name": name, "error": traceback.format_exc()[-1500:]})
            report("done", {"name": name, "seconds": round(time.perf_counter() - t0, 1)})
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
