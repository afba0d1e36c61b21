"""Decode speed of `llmopt generate`'s runtime next to transformers' `generate`, in one run.

Same weights (SmolLM2-135M converted to an HF dir), same dtype, same thread count, batch 1, greedy,
128 new tokens (EOS ignored). Each engine runs `--repeats` times, alternating, and the best run
counts (the least disturbed by other work on the machine). Also: prompt-lookup speculation on a
prompt that asks to repeat a paragraph and one that asks to edit it (same text required), and, with `--llama-cpp`, llama.cpp on
the original GGUF for context (its Q4_1 weights, so a different workload). With `--device cuda` it
adds batch-1 decode of a Llama-3-8B-shaped model with random bf16 weights as a fraction of the
memory-bandwidth roofline. Prints a table and one JSON line.

Usage: python benchmarks/runtime.py [--threads N] [--repeats 3] [--device cpu|cuda] [--llama-cpp] [--gptq DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

PROMPT = "Write a short story about a robot who learns to paint."
PARAGRAPH = ("The committee met on Tuesday to discuss the budget for the next fiscal year. After a long debate, the "
             "members agreed to increase funding for public libraries, to hire two more librarians, and to reduce "
             "spending on road repairs until the spring. The chair thanked everyone for their patience and closed "
             "the meeting at nine o'clock.")
LOOKUP_PROMPTS = {
    "repeat": f"Repeat the following paragraph exactly.\n\n{PARAGRAPH}\n\nRepeated paragraph:\n",
    "edit": f"Rewrite the following paragraph in the past perfect tense.\n\n{PARAGRAPH}\n\nRewritten paragraph:\n",
}


class FirstTokenTimer:
    """A transformers streamer that notes when the first new token arrives (the prompt comes first)."""

    def __init__(self):
        self.calls, self.first = 0, None

    def put(self, value):
        self.calls += 1
        if self.calls == 2:
            self.first = time.perf_counter()

    def end(self):
        pass


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench_transformers(model, ids, new_tokens, device):
    timer = FirstTokenTimer()
    sync(device)
    t0 = time.perf_counter()
    out = model.generate(torch.tensor([ids], device=device), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, eos_token_id=None, pad_token_id=0, streamer=timer)
    sync(device)
    t1 = time.perf_counter()
    return {"ttft_ms": 1000 * (timer.first - t0), "tokens_per_s": (new_tokens - 1) / (t1 - timer.first),
            "tokens": out[0, len(ids):].tolist()}


def bench_llmopt(gen, ids, new_tokens):
    r = gen.generate(ids, new_tokens, ignore_eos=True)
    m = r.metrics
    return {"ttft_ms": m.ttft_ms, "tokens_per_s": m.tokens_per_s, "tokens": r.token_ids,
            "acceptance_rate": m.acceptance_rate, "text": r.text}


def best(runs):
    return max(runs, key=lambda r: r["tokens_per_s"])


def llama3_8b_arch():
    """Llama-3-8B's shape (random weights stand in for its own)."""
    from llmopt.model.arch import ArchSpec
    from llmopt.model.families import family_for_hf

    return ArchSpec(family=family_for_hf(["LlamaForCausalLM"], "llama"), hidden_size=4096, num_layers=32, num_heads=32,
                    num_kv_heads=8, head_dim=128, intermediate_size=14336, vocab_size=128256,
                    max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                    attention_bias=False)


def decode_roofline(model, device, weight_bytes: int, new_tokens: int = 128, compile: bool = False) -> dict:
    """Batch-1 decode of `model` (no tokenizer, EOS ignored) as bytes read per token (`weight_bytes`: every
    weight but the embedding table, of which a step reads one row) times tokens/s, against the GPU's peak."""
    from llmopt.runtime.generate import Generator

    gen = Generator(model, None, eos=set(), compile=compile)
    ids = list(range(1, 33))
    t0 = time.perf_counter()
    gen.generate(ids, 8, ignore_eos=True)  # warm-up (and compile)
    warm_s = time.perf_counter() - t0
    r = gen.generate(ids, new_tokens, ignore_eos=True)
    bandwidth = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        # peak bandwidth from the memory clock (kHz) and bus width (bits), DDR: 2 transfers per clock
        if hasattr(props, "memory_clock_rate"):
            bandwidth = 2 * props.memory_clock_rate * 1e3 * props.memory_bus_width / 8
    achieved = weight_bytes * r.metrics.tokens_per_s
    return {"weights_gb": weight_bytes / 1e9, "tokens_per_s": r.metrics.tokens_per_s,
            "ms_per_token": 1e3 / r.metrics.tokens_per_s,
            "achieved_gb_s": achieved / 1e9, "peak_gb_s": bandwidth / 1e9 if bandwidth else None,
            "fraction_of_roofline": achieved / bandwidth if bandwidth else None, "warm_up_s": warm_s}


def roofline_8b(device, new_tokens=128, compile=False):
    """Batch-1 decode of a Llama-3-8B-shaped model, random bf16 weights, vs HBM bandwidth
    (`compile`: the torch.compile'd fixed-shape step, recorded as a CUDA graph)."""
    from llmopt.model.decoder import Decoder, Rotary

    arch = llama3_8b_arch()
    with torch.device(device):
        model = Decoder(arch).to(torch.bfloat16)
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.02)
        model.rotary = Rotary(arch).to(device)
    model.eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) - model.embed_tokens.weight.nbytes
    return decode_roofline(model, device, weight_bytes, new_tokens, compile)


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import transformers

    from llmopt.formats.hf import write_hf_dir
    from llmopt.model import open_model
    from llmopt.model.embedded import smollm2_gguf
    from llmopt.runtime.generate import Generator
    from llmopt.runtime.speculative import PromptLookup
    from llmopt.runtime.weights import load_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--llama-cpp", action="store_true")
    ap.add_argument("--gptq", help="a 4-bit GPTQ dir of SmolLM2 (llmopt quantize): decode packed vs dequantized")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    gguf = smollm2_gguf()
    results: dict = {"threads": args.threads, "device": str(device), "dtype": args.dtype, "new_tokens": args.new_tokens}

    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = Path(tmp) / "smollm2"
        with open_model(gguf) as src:
            write_hf_dir(src, hf_dir, dtype="float32")
        ours = load_model(str(hf_dir), args.dtype, args.device)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=getattr(torch, args.dtype)).to(device).eval()
        tok = ours.tokenizer
        ids = tok.encode(PROMPT)
        gen = Generator(ours.model, tok)
        bench_llmopt(gen, ids, 8)  # warm-up both
        bench_transformers(theirs, ids, 8, device)
        runs = {"llmopt": [], "transformers": []}
        for _ in range(args.repeats):
            runs["llmopt"].append(bench_llmopt(gen, ids, args.new_tokens))
            runs["transformers"].append(bench_transformers(theirs, ids, args.new_tokens, device))
        a, b = best(runs["llmopt"]), best(runs["transformers"])
        results["decode"] = {
            "llmopt": {k: round(a[k], 2) for k in ("ttft_ms", "tokens_per_s")},
            "transformers": {k: round(b[k], 2) for k in ("ttft_ms", "tokens_per_s")},
            "speedup": round(a["tokens_per_s"] / b["tokens_per_s"], 2),
            "same_tokens": a["tokens"] == b["tokens"],
        }

        lookup = Generator(ours.model, tok, PromptLookup(3), num_draft=8)
        results["prompt_lookup"] = {}
        for name, prompt in LOOKUP_PROMPTS.items():
            prompt_ids = tok.encode(prompt)
            plain_runs, lookup_runs = [], []
            for _ in range(args.repeats):
                plain_runs.append(bench_llmopt(gen, prompt_ids, args.new_tokens))
                lookup_runs.append(bench_llmopt(lookup, prompt_ids, args.new_tokens))
            p, q = best(plain_runs), best(lookup_runs)
            results["prompt_lookup"][name] = {
                "plain_tokens_per_s": round(p["tokens_per_s"], 2), "lookup_tokens_per_s": round(q["tokens_per_s"], 2),
                "speedup": round(q["tokens_per_s"] / p["tokens_per_s"], 2), "acceptance_rate": round(q["acceptance_rate"], 3),
                "same_text": p["text"] == q["text"],
            }

        if args.gptq:  # a GPTQ checkpoint of the same model: packed (`--dtype`'s path) vs dequantized
            for mode, packed in (("packed_int4", True), ("dequantized", False)):
                g = load_model(args.gptq, args.dtype, args.device, quantized=packed)
                gq = Generator(g.model, g.tokenizer)
                bench_llmopt(gq, ids, 8)
                results.setdefault("gptq", {})[mode] = {"tokens_per_s": round(
                    best([bench_llmopt(gq, ids, args.new_tokens) for _ in range(args.repeats)])["tokens_per_s"], 2)}

    if args.llama_cpp:
        from llama_cpp import Llama

        llm = Llama(model_path=str(gguf), n_threads=args.threads, n_ctx=512, verbose=False)
        speeds = []
        for _ in range(args.repeats):
            llm.reset()
            t0 = time.perf_counter()
            first = None
            n = 0
            for _tok in llm.generate(ids, temp=0.0, reset=True):
                n += 1
                if first is None:
                    first = time.perf_counter()
                if n == args.new_tokens:
                    break
            speeds.append((n - 1) / (time.perf_counter() - first))
        results["llama_cpp_q4_1"] = {"tokens_per_s": round(max(speeds), 2)}

    if device.type == "cuda":
        results["llama3_8b_shape_bf16"] = roofline_8b(device)
        results["llama3_8b_shape_bf16_compiled"] = roofline_8b(device, compile=True)

    d = results["decode"]
    print(f"{'engine':<28}{'TTFT ms':>10}{'decode tok/s':>14}")
    print(f"{'llmopt':<28}{d['llmopt']['ttft_ms']:>10.1f}{d['llmopt']['tokens_per_s']:>14.2f}")
    print(f"{'transformers generate':<28}{d['transformers']['ttft_ms']:>10.1f}{d['transformers']['tokens_per_s']:>14.2f}")
    if "llama_cpp_q4_1" in results:
        print(f"{'llama.cpp (Q4_1 GGUF)':<28}{'':>10}{results['llama_cpp_q4_1']['tokens_per_s']:>14.2f}")
    print(f"llmopt / transformers: {d['speedup']}x (same tokens: {d['same_tokens']})")
    for name, pl in results["prompt_lookup"].items():
        print(f"prompt lookup ({name} a paragraph): {pl['lookup_tokens_per_s']} vs {pl['plain_tokens_per_s']} tok/s "
              f"= {pl['speedup']}x, acceptance {pl['acceptance_rate']}, same text: {pl['same_text']}")
    for mode, r in results.get("gptq", {}).items():
        print(f"GPTQ 4-bit, {mode}: {r['tokens_per_s']} tok/s")
    for key, label in (("llama3_8b_shape_bf16", "eager"), ("llama3_8b_shape_bf16_compiled", "compiled")):
        if key in results:
            r = results[key]
            print(f"Llama-3-8B shape bf16, {label}: {r['tokens_per_s']:.1f} tok/s, {r['achieved_gb_s']:.0f} GB/s of "
                  f"{r['peak_gb_s']} GB/s = {100 * (r['fraction_of_roofline'] or 0):.1f}% of roofline")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
