"""llmopt's GGUF writer vs llama.cpp's llama_model_quantize on SmolLM2-135M, same machine, same threads.

For each type: wall time and peak RSS of `llmopt` (fp16 HF dir -> GGUF) and of llama.cpp (llmopt's F16
GGUF -> GGUF, what llama-quantize does), output size, and the share of blocks that are byte-identical
between the two files, per GGML type. Each job runs in its own process so peak RSS is its own.
Optional: perplexity on wikitext-2 test computed by llama.cpp on both files, and a Llama-2-7B-shaped
random fp16 model (about 13.5 GB on disk) to check that peak memory follows the largest tensor.

    python benchmarks/gguf_quantize.py                      # Q8_0, Q6_K, Q4_K_M, IQ4_XS
    python benchmarks/gguf_quantize.py --types all --perplexity 40 --imatrix-chunks 40
    python benchmarks/gguf_quantize.py --llama7b /big/disk  # needs ~30 GB free
    python benchmarks/gguf_quantize.py --types IQ3_XXS,IQ2_XXS --imatrix-chunks 10 --models wide  # i-quants
Mixes that llama-quantize refuses without an importance matrix (IQ3_XXS, IQ3_XS, IQ2_*) run only
with one (`--imatrix-chunks`).
Prints a table, then JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.proc_status import status_kib  # noqa: E402


# ------------------------------------------------------------------------------------------ jobs
def job_llmopt(src: str, out: str, mix: str, imatrix: str | None) -> dict:
    from llmopt.formats.imatrix import read_imatrix
    from llmopt.formats.gguf.writer import plan_gguf, write_gguf
    from llmopt.model import open_model

    imat = read_imatrix(Path(imatrix)) if imatrix else None
    start = time.perf_counter()
    with open_model(src) as source:
        plan = plan_gguf(source, mix, has_imatrix=imat is not None)
        write_gguf(source, Path(out), plan, importance=None if imat is None else imat.importance())
    return {"seconds": time.perf_counter() - start}


def job_llama(src: str, out: str, mix: str, imatrix: str | None, threads: int) -> dict:
    from llmopt.formats.imatrix import read_imatrix
    from tests.formats.gguf.llama_cpp_helpers import llama_quantize

    imat = None if not imatrix else {k: v.numpy() for k, v in read_imatrix(Path(imatrix)).importance().items()}
    start = time.perf_counter()
    llama_quantize(Path(src), Path(out), mix, nthread=threads, imatrix=imat)
    return {"seconds": time.perf_counter() - start}


def job_perplexity(model: str, text: str, chunks: int, threads: int) -> dict:
    """llama.cpp's perplexity recipe: ctx 512 chunks, scored on the second half of each chunk."""
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(model_path=model, n_ctx=512, n_batch=512, logits_all=True, verbose=False, n_threads=threads)
    tokens = llm.tokenize(Path(text).read_text().encode(), add_bos=False)
    nll, count = 0.0, 0
    for c in range(min(chunks, len(tokens) // 512)):
        ids = tokens[c * 512 : (c + 1) * 512]
        llm.reset()
        llm.eval(ids)
        logits = np.asarray(llm.scores[:512], dtype=np.float64)
        logits -= logits.max(axis=1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        for i in range(256, 511):
            nll -= logp[i, ids[i + 1]]
            count += 1
    return {"perplexity": float(np.exp(nll / count)), "tokens": count}


def peak_rss_mb() -> float:
    """This process's peak RSS (VmHWM; see benchmarks/proc_status.py), ru_maxrss where /proc is absent."""
    hwm = status_kib().get("VmHWM")
    return hwm / 1024 if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_job(*args: str) -> dict:
    """Run one job in a fresh process; returns its result plus its peak RSS."""
    proc = subprocess.run([sys.executable, __file__, "--job", *args], capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -------------------------------------------------------------------------------------- compare
def identical_blocks(a: Path, b: Path) -> dict[str, list[int]]:
    """Per GGML type: [identical blocks, blocks] between two GGUF files of the same tensors."""
    import gguf
    import numpy as np

    ta = {t.name: t for t in gguf.GGUFReader(str(a)).tensors}
    out: dict[str, list[int]] = {}
    for t in gguf.GGUFReader(str(b)).tensors:
        mine = ta[t.name]
        kind = t.tensor_type.name
        if mine.tensor_type != t.tensor_type:
            out.setdefault(f"type mismatch {kind}", [0, 0])[1] += 1
            continue
        block, nbytes = gguf.GGML_QUANT_SIZES[t.tensor_type]
        x = np.asarray(mine.data).view(np.uint8).reshape(-1, nbytes if block > 1 else 1)
        y = np.asarray(t.data).view(np.uint8).reshape(-1, nbytes if block > 1 else 1)
        same = (x == y).all(axis=1)
        acc = out.setdefault(kind, [0, 0])
        acc[0] += int(same.sum())
        acc[1] += int(same.size)
    return out


def tensor_data_sha256(path: Path) -> str:
    """sha256 over (name, bytes) of every tensor in name order: equal hashes = identical tensor data
    (the metadata differs between the tools: llmopt's provenance keys)."""
    import hashlib

    import gguf
    import numpy as np

    h = hashlib.sha256()
    for t in sorted(gguf.GGUFReader(str(path)).tensors, key=lambda t: t.name):
        h.update(t.name.encode())
        h.update(np.asarray(t.data).tobytes())
    return h.hexdigest()


def smollm2_hf(work: Path) -> Path:
    from llmopt.formats.hf import write_hf_dir
    from llmopt.model import open_model
    from llmopt.model.embedded import smollm2_gguf

    out = work / "smollm2-f16"
    with open_model(smollm2_gguf()) as src:
        write_hf_dir(src, out, dtype="float16")
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--job":
        kind, *rest = sys.argv[2:]
        fn = {"llmopt": job_llmopt, "llama": job_llama, "ppl": job_perplexity}[kind]
        if kind == "llmopt":
            result = fn(rest[0], rest[1], rest[2], rest[3] or None)
        elif kind == "llama":
            result = fn(rest[0], rest[1], rest[2], rest[3] or None, int(rest[4]))
        else:
            result = fn(rest[0], rest[1], int(rest[2]), int(rest[3]))
        result["peak_rss_mb"] = peak_rss_mb()
        print(json.dumps(result))
        return

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--types", default="Q8_0,Q6_K,Q4_K_M,IQ4_XS", help="comma list, or 'all'")
    p.add_argument("--threads", type=int, default=0, help="threads for both (0 = torch's default)")
    p.add_argument("--perplexity", type=int, default=0, help="wikitext-2 test chunks of 512 (0 = skip)")
    p.add_argument("--imatrix-chunks", type=int, default=0, help="also compare imatrix-weighted files")
    p.add_argument("--repeat", type=int, default=1,
                   help="run each job N times, alternating llmopt and llama.cpp, and report the fastest of each "
                        "(a noisy machine); the first llmopt run of a fresh checkout also compiles numba's kernels")
    p.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "wikitext-2"))
    p.add_argument("--llama7b", default=None, help="folder for the 13.5 GB Llama-2-7B-shaped peak-RSS run")
    p.add_argument("--llama7b-llama", action="store_true",
                   help="also time llama.cpp on the 7B shape (needs an extra 13.5 GB F16 GGUF, written by llmopt)")
    p.add_argument("--llama7b-keep", action="store_true", help="keep the 7B-shaped HF dir for the next run (and reuse one found)")
    p.add_argument("--wide-layers", type=int, default=4, help="layers of the wide random model")
    p.add_argument("--models", default="smollm2,wide",
                   help="comma list: smollm2 (hidden 576: K mixes fall back to legacy types on most tensors), "
                        "wide (random llama, hidden 1024, FFN 2816, 4 layers: K-quants on every tensor)")
    args = p.parse_args()

    import torch

    from llmopt.formats.gguf.mixes import MIXES

    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    types = [m for m in MIXES if m not in ("F16", "BF16")] if args.types == "all" else args.types.split(",")
    rows, report = [], {"threads": threads, "types": {}, "loadavg_start": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp:
        for model in [m for m in args.models.split(",") if m]:
            work = Path(tmp) / model
            work.mkdir()
            hf = smollm2_hf(work) if model == "smollm2" else wide_hf(work, args.wide_layers)
            bench_model(model, hf, work, types, threads, args, rows, report)
        if args.llama7b:
            report["llama7b"] = llama7b_peak(Path(args.llama7b), threads, args.llama7b_llama, args.llama7b_keep)
    report["loadavg_end"] = os.getloadavg()
    print(f"load average start {report['loadavg_start']}, end {report['loadavg_end']}")
    print(f"{'model':8} {'type':16} {'llmopt s':>9} {'llama s':>8} {'ratio':>6} {'RSS MB':>7} {'llamaRSS':>8} {'bytes':>11}  identical blocks")
    for model, tag, ta, tb, ra, rb, size, ident, pa, pb in rows:
        ppl = f"  ppl {pa:.4f} vs {pb:.4f}" if pa else ""
        print(f"{model:8} {tag:16} {ta:9.2f} {tb:8.2f} {ta / tb:6.2f} {ra:7.0f} {rb:8.0f} {size:11d}  {ident}{ppl}")
    print(json.dumps(report, indent=1))


def wide_hf(work: Path, layers: int = 4) -> Path:
    """A random llama whose every matrix row divides into 256, so K mixes use K-quants everywhere."""
    from tests.formats.gguf.models import make_wide_hf

    return make_wide_hf(work / "wide-f16", hidden=1024, ffn=2816, layers=layers, heads=8, kv_heads=4)


def needs_imatrix(hf: Path, mix: str) -> bool:
    """llama-quantize refuses `mix` for this model without an importance matrix (mixes.requires_imatrix)."""
    from llmopt.formats.gguf.mixes import requires_imatrix
    from llmopt.formats.gguf.writer import plan_gguf
    from llmopt.model import open_model

    with open_model(hf) as src:
        return any(requires_imatrix(t.gguf_name, t.type_name, mix) for t in plan_gguf(src, mix).tensors)


def fastest(best: dict | None, new: dict) -> dict:
    """The run with the lower wall time (every run's seconds kept in `runs`)."""
    runs = (best or {}).get("runs", []) + [new["seconds"]]
    return {**(new if best is None or new["seconds"] < best["seconds"] else best), "runs": runs}


def bench_model(model: str, hf: Path, work: Path, types: list[str], threads: int, args, rows: list, report: dict) -> None:  # noqa: ANN001
    """Every type on one model: llmopt (HF dir) and llama.cpp (llmopt's F16 GGUF), one after the other."""
    f16 = work / "F16.gguf"
    report.setdefault("F16_llmopt", {})[model] = run_job("llmopt", str(hf), str(f16), "F16", "")
    imatrix = ""
    if args.imatrix_chunks:
        imatrix = str(work / "imatrix.gguf")
        subprocess.run([sys.executable, "-m", "llmopt.cli.app", "imatrix", str(hf), "--calib",
                        f"{args.data}/valid.txt", "-o", imatrix, "--chunks", str(args.imatrix_chunks)],
                       check=True, cwd=ROOT)  # fmt: skip
    for mix in types:
        weightings = [True] if needs_imatrix(hf, mix) else [False, True]
        if not imatrix and weightings == [True]:
            raise SystemExit(f"{mix} needs an importance matrix: add --imatrix-chunks N")
        for weighted in (weightings if imatrix else [False]):
            tag = mix + ("+imatrix" if weighted else "")
            ours, theirs = work / f"{tag}.ours.gguf", work / f"{tag}.llama.gguf"
            a = b = None
            for _ in range(args.repeat):  # alternating, so both see the same background load; the fastest of each
                a = fastest(a, run_job("llmopt", str(hf), str(ours), mix, imatrix if weighted else ""))
                b = fastest(b, run_job("llama", str(f16), str(theirs), mix, imatrix if weighted else "", str(threads)))
            same = identical_blocks(ours, theirs)
            entry = {"llmopt": a, "llama_cpp": b, "bytes": ours.stat().st_size,
                     "llama_cpp_bytes": theirs.stat().st_size, "tensor_data_sha256": {
                         "llmopt": tensor_data_sha256(ours), "llama_cpp": tensor_data_sha256(theirs)},
                     "identical_blocks": {k: f"{100 * v[0] / max(v[1], 1):.3f}% of {v[1]}" for k, v in same.items()}}
            if args.perplexity:
                entry["ppl_llmopt"] = run_job("ppl", str(ours), f"{args.data}/test.txt", str(args.perplexity), str(threads))
                entry["ppl_llama_cpp"] = run_job("ppl", str(theirs), f"{args.data}/test.txt", str(args.perplexity), str(threads))
            report["types"][f"{model} {tag}"] = entry
            rows.append((model, tag, a["seconds"], b["seconds"], a["peak_rss_mb"], b["peak_rss_mb"], entry["bytes"],
                         ", ".join(f"{k} {v}" for k, v in entry["identical_blocks"].items())
                         + ("; tensor data sha256 equal" if len(set(entry["tensor_data_sha256"].values())) == 1 else "; sha256 DIFFER"),
                         entry.get("ppl_llmopt", {}).get("perplexity"), entry.get("ppl_llama_cpp", {}).get("perplexity")))
            ours.unlink()
            theirs.unlink()


def llama7b_peak(folder: Path, threads: int, with_llama: bool, keep: bool = False) -> dict:
    """Write a Llama-2-7B-shaped random fp16 HF dir (safetensors shards), then Q4_K_M it with llmopt (and,
    with `with_llama`, with llama.cpp from llmopt's F16 GGUF of it). Deletes everything it wrote unless
    `keep` (then a later run reuses the HF dir)."""
    import torch
    from safetensors.torch import save_file

    hf = folder / "llama2-7b-random"
    hf.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
           "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
           "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}
    index = hf / "model.safetensors.index.json"
    if index.exists():
        return _llama7b_quantize(folder, hf, threads, with_llama, keep)
    (hf / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(0)
    weight_map = {}
    shapes = {"model.embed_tokens.weight": (32000, 4096), "lm_head.weight": (32000, 4096), "model.norm.weight": (4096,)}
    for i in range(32):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (4096,), p + "post_attention_layernorm.weight": (4096,),
                       **{p + f"self_attn.{x}_proj.weight": (4096, 4096) for x in "qkvo"},
                       p + "mlp.gate_proj.weight": (11008, 4096), p + "mlp.up_proj.weight": (11008, 4096),
                       p + "mlp.down_proj.weight": (4096, 11008)})
    names = list(shapes)
    for shard in range(0, len(names), 20):
        part = {n: (torch.randn(shapes[n], generator=g) * 0.02).half() for n in names[shard : shard + 20]}
        fname = f"model-{shard // 20:05d}.safetensors"
        save_file(part, str(hf / fname))
        weight_map.update({n: fname for n in part})
        del part
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return _llama7b_quantize(folder, hf, threads, with_llama, keep)


def _llama7b_quantize(folder: Path, hf: Path, threads: int, with_llama: bool, keep: bool) -> dict:
    out = folder / "llama2-7b-random-Q4_K_M.gguf"
    try:
        result = {"llmopt": run_job("llmopt", str(hf), str(out), "Q4_K_M", "")}
        result["bytes"] = out.stat().st_size
        if with_llama:
            f16 = folder / "llama2-7b-random-F16.gguf"
            result["llmopt_F16"] = run_job("llmopt", str(hf), str(f16), "F16", "")
            theirs = folder / "llama2-7b-random-Q4_K_M.llama.gguf"
            result["llama_cpp"] = run_job("llama", str(f16), str(theirs), "Q4_K_M", "", str(threads))
            f16.unlink()
            result["identical_blocks"] = {k: f"{100 * v[0] / max(v[1], 1):.3f}% of {v[1]}"
                                          for k, v in identical_blocks(out, theirs).items()}
            result["tensor_data_sha256"] = {"llmopt": tensor_data_sha256(out), "llama_cpp": tensor_data_sha256(theirs)}
            theirs.unlink()
        print(json.dumps({"llama7b": result}), file=sys.stderr)
        return result
    finally:
        import shutil

        if not keep:
            shutil.rmtree(hf, ignore_errors=True)
        for f in folder.glob("llama2-7b-random*.gguf"):
            f.unlink()

if __name__ == "__main__":
    main()
