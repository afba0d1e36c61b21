"""GGUF weights kept quantized in memory (llmopt/runtime/gguf_linear.py): decode speed and memory.

(a) SmolLM2-135M written by llmopt as Q4_0, Q4_K_M and Q8_0: decode tokens/s of the runtime with the
    weights quantized in memory (float32: exact paths; bfloat16: Q4 types on torch's int4 kernel), with
    them dequantized to float32 (the old path), and llama.cpp (llama-cpp-python) on the same file, same
    threads; plus the bytes each llmopt model holds. `--mixes` picks the files; `--compile` adds the
    float32 runs with the compiled decode step (`generate --compile`).
(b) A Llama-2-7B-shaped model (hidden 4096, 32 layers, ffn 11008, vocab 32000) of random float16 weights,
    written by llmopt's GGUF writer as Q4_0 and Q4_K_M straight from a source that makes each tensor when the
    writer asks (no 13 GB float16 copy on disk), then loaded and run for --tokens tokens in a fresh
    process whose peak RSS (VmHWM) is reported against the file size plus the KV cache (target <= 1.3x).

Final numbers (quiet machine):
    python benchmarks/runtime_quantized.py --threads 2 --json out.json
Quick check on a small setting:
    python benchmarks/runtime_quantized.py --threads 1 --tokens 8 --layers 2 --hidden 512 --ffn 1408 --vocab 4096
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from proc_status import status_kib  # noqa: E402

from llmopt.formats.gguf.mixes import MIXES as GGUF_MIXES  # noqa: E402
from llmopt.formats.gguf.mixes import requires_imatrix  # noqa: E402
from llmopt.formats.gguf.writer import plan_gguf, write_gguf  # noqa: E402
from llmopt.model import open_model  # noqa: E402
from llmopt.model.arch import ArchSpec  # noqa: E402
from llmopt.model.decoder import Decoder  # noqa: E402
from llmopt.model.source import ModelSource, TensorInfo  # noqa: E402

MIXES = ("Q4_0", "Q4_K_M", "Q8_0")
PROMPT = "The history of the Roman Empire"


def write_planned(src: ModelSource, mix: str, out: Path) -> None:
    """`mix` written as llmopt writes it; a mix llama.cpp writes only with an importance matrix (IQ2_XXS, IQ1_M,
    ...) gets a flat one: this benchmark times decoding, on which the matrix has no bearing."""
    plan = plan_gguf(src, mix, has_imatrix=False)
    flat = None
    if any(requires_imatrix(t.gguf_name, t.type_name, mix) for t in plan.tensors):
        plan = plan_gguf(src, mix, has_imatrix=True)
        flat = {t.gguf_name: torch.ones(t.shape[-1]) for t in plan.tensors if len(t.shape) == 2}
    write_gguf(src, out, plan, importance=flat)


def write_mix(source_path: Path, mix: str, out: Path) -> Path:
    if not out.exists():
        with open_model(source_path) as src:
            write_planned(src, mix, out)
    return out


def held_bytes(model: torch.nn.Module) -> int:
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        key = (id(t),) if t.is_mkldnn else (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))  # oneDNN's: no storage
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def llmopt_decode(path: Path, dtype: str, packed: bool, ids: list[int], tokens: int, compile: bool = False) -> dict:
    from llmopt.runtime.generate import Generator
    from llmopt.runtime.weights import load_model

    loaded = load_model(str(path), dtype, "cpu", quantized=packed)
    gen = Generator(loaded.model, loaded.tokenizer, compile=compile)
    gen.generate(ids, 4, ignore_eos=True)  # warm-up (and, compiled, the compile)
    m = gen.generate(ids, tokens, ignore_eos=True).metrics
    return {"tokens_per_s": round(m.tokens_per_s, 2), "held_mib": round(held_bytes(loaded.model) / 2**20, 1)}


def llama_cpp_decode(path: Path, ids: list[int], tokens: int, threads: int) -> dict:
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_threads=threads, n_ctx=512, verbose=False)
    best = 0.0
    for _ in range(2):
        llm.reset()
        n, first = 0, None
        for _tok in llm.generate(ids, temp=0.0, reset=True):
            n += 1
            first = first or time.perf_counter()
            if n == tokens:
                break
        best = max(best, (n - 1) / (time.perf_counter() - first))
    return {"tokens_per_s": round(best, 2)}


def smollm2_table(work: Path, tokens: int, threads: int, mixes: list[str], compile: bool = False) -> dict:
    from llmopt.model.embedded import smollm2_gguf

    base = smollm2_gguf()
    with open_model(base) as src:
        ids = src.tokenizer().encode(PROMPT)
    out = {}
    for mix in mixes:
        path = write_mix(base, mix, work / f"smollm2-{mix}.gguf")
        row = {"file_mib": round(path.stat().st_size / 2**20, 1)}
        row["quantized_fp32"] = llmopt_decode(path, "float32", True, ids, tokens)
        row["quantized_bf16"] = llmopt_decode(path, "bfloat16", True, ids, tokens)
        row["dequantized_fp32"] = llmopt_decode(path, "float32", False, ids, tokens)
        if compile:  # generate --compile: the fixed-shape step compiled by inductor
            row["quantized_fp32_compiled"] = llmopt_decode(path, "float32", True, ids, tokens, compile=True)
            row["dequantized_fp32_compiled"] = llmopt_decode(path, "float32", False, ids, tokens, compile=True)
        try:
            row["llama_cpp"] = llama_cpp_decode(path, ids, tokens, threads)
        except ImportError:
            row["llama_cpp"] = {"tokens_per_s": None, "note": "llama-cpp-python not installed"}
        out[mix] = row
    return out


class RandomLlamaSource(ModelSource):
    """A Llama-shaped model whose float16 tensors are drawn (seeded by name) when the writer asks for
    them, so a 7B GGUF is written without its 13 GB float16 source on disk."""

    kind = "hf"

    def __init__(self, hidden: int, layers: int, ffn: int, vocab: int, heads: int, kv_heads: int):
        self.path = Path("random-llama")
        self.metadata = {}
        self.arch = ArchSpec.from_hf_config({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
            "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "vocab_size": vocab, "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False})
        with torch.device("meta"):  # the runtime's own parameter list gives every name and shape
            params = dict(Decoder(self.arch).named_parameters())
        shapes = {("" if n.startswith("lm_head") else "model.") + n: tuple(p.shape) for n, p in params.items()}
        self.tensors = {n: TensorInfo(n, n, s, "F16", 2 * torch.Size(s).numel()) for n, s in shapes.items()}

    def load(self, name: str, dtype: torch.dtype | str | None = "float32") -> torch.Tensor:
        shape = self.tensors[name].shape
        if len(shape) == 1:
            return torch.ones(shape)
        g = torch.Generator().manual_seed(sum(map(ord, name)) * 7919 + len(name))
        return (torch.randn(shape, generator=g) * 0.02).to(torch.float16).float()

    def tokenizer(self):
        return None


def run_7b_child(path: str, tokens: int, threads: int) -> None:
    """In a fresh process: load the file with weights quantized in memory, decode, print peak RSS."""
    from llmopt.runtime.generate import Generator
    from llmopt.runtime.weights import load_model

    torch.set_num_threads(threads)
    before = status_kib()  # the interpreter and torch, before any weight
    t0 = time.perf_counter()
    loaded = load_model(path, "float32", "cpu", quantized=True)
    load_s = time.perf_counter() - t0
    after_load = status_kib()
    m = Generator(loaded.model, None).generate([1, 2, 3, 4, 5, 6, 7, 8], tokens, ignore_eos=True).metrics
    arch = loaded.model.arch
    kv = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * (8 + tokens) * 4  # float32 cache
    end = status_kib()
    print(json.dumps({"load_s": round(load_s, 1), "tokens_per_s": round(m.tokens_per_s, 3),
                      "rss_before_load_kib": before.get("VmRSS"),
                      "rss_after_load_kib": after_load.get("VmRSS"), "peak_rss_kib": end.get("VmHWM"),
                      "kv_cache_bytes": kv, "held_bytes": held_bytes(loaded.model)}))


def seven_b(work: Path, args: argparse.Namespace, mix: str) -> dict:
    src = RandomLlamaSource(args.hidden, args.layers, args.ffn, args.vocab, args.heads, args.kv_heads)
    path = work / f"random-llama-h{args.hidden}-l{args.layers}-{mix}.gguf"
    if not path.exists():
        t0 = time.perf_counter()
        write_planned(src, mix, path)
        print(f"wrote {path} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    child = subprocess.run([sys.executable, __file__, "--child-7b", str(path), "--tokens", str(args.tokens),
                            "--threads", str(args.threads)], capture_output=True, text=True, check=True)
    row = json.loads(child.stdout.strip().splitlines()[-1])
    size = path.stat().st_size
    row["file_bytes"] = size
    row["peak_over_file_plus_kv"] = round(row["peak_rss_kib"] * 1024 / (size + row["kv_cache_bytes"]), 3)
    # the same without the interpreter's own resident memory (torch and its libraries, ~0.3 GB)
    row["peak_less_baseline_over_file_plus_kv"] = round(
        (row["peak_rss_kib"] - row["rss_before_load_kib"]) * 1024 / (size + row["kv_cache_bytes"]), 3)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens per run (SmolLM2 and 7B)")
    ap.add_argument("--workdir", type=Path, default=None, help="where the GGUF files go (default: a temp dir)")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--ffn", type=int, default=11008)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=32)
    ap.add_argument("--mixes", default=",".join(MIXES), help="the types SmolLM2 is written as (any llmopt mix)")
    ap.add_argument("--compile", action="store_true", help="SmolLM2 also with the compiled decode step (float32)")
    ap.add_argument("--skip-smollm2", action="store_true")
    ap.add_argument("--skip-7b", action="store_true")
    ap.add_argument("--seven-b-types", default="Q4_0,Q4_K_M", help="the types the 7B-shaped model is written as")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--child-7b", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    unknown = [m for m in args.mixes.split(",") + args.seven_b_types.split(",") if m not in GGUF_MIXES]
    if unknown:
        ap.error(f"unknown mix {unknown[0]!r}; have {', '.join(GGUF_MIXES)}")
    if args.child_7b:
        return run_7b_child(args.child_7b, args.tokens, args.threads)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        results: dict = {"threads": args.threads, "tokens": args.tokens}
        if not args.skip_smollm2:
            results["smollm2"] = smollm2_table(work, args.tokens, args.threads, args.mixes.split(","), args.compile)
            print(f"{'SmolLM2 file':<10}{'MiB':>7}  {'decode tok/s (weights held, MiB)':<70}")
            for mix, row in results["smollm2"].items():
                cells = "  ".join(f"{k}={row[k]['tokens_per_s']}" + (f" ({row[k]['held_mib']} MiB)" if "held_mib" in row[k] else "")
                                  for k in ("quantized_fp32", "quantized_bf16", "dequantized_fp32",
                                            "quantized_fp32_compiled", "dequantized_fp32_compiled", "llama_cpp")
                                  if k in row)
                print(f"{mix:<10}{row['file_mib']:>7}  {cells}")
        for mix in [] if args.skip_7b else args.seven_b_types.split(","):
            results[f"llama7b_shape_{mix.lower()}"] = r = seven_b(work, args, mix)
            print(f"\n{args.layers}-layer hidden-{args.hidden} {mix}: file {r['file_bytes'] / 2**30:.2f} GiB, KV "
                  f"{r['kv_cache_bytes'] / 2**20:.1f} MiB, peak RSS {r['peak_rss_kib'] / 2**20:.2f} GiB = "
                  f"{r['peak_over_file_plus_kv']}x file+KV (target <= 1.3; {r['peak_less_baseline_over_file_plus_kv']}x "
                  f"less the {r['rss_before_load_kib'] / 2**10:.0f} MiB before loading), {r['tokens_per_s']} tok/s, load {r['load_s']} s")
        print(json.dumps(results, indent=1))
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
