"""Does the Fisher-predicted KL of one tensor's rounding agree with the KL measured when only that
tensor is rounded? The automatic mix (`convert --target-size`, `quantize --target-bpw`) trusts it.

On the off-grid reference model: the cost table of `convert --target-size` (32 samples of 512
tokens of wikitext-2 valid.txt, cached), then for a spread of tensors the float model with only that
tensor rounded (at a low type its rows allow: Q2_K, else Q4_0; the same importance-weighted
rounding the table used), scored against the float model by llmopt's KL divergence on test.txt
(ctx 512, --windows). Prints both per tensor, the ratio, and the Spearman rank correlation; the
JSON line carries them.

Usage:
  python benchmarks/sensitivity_agreement.py [--windows 8] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.quality import DATA, source_model  # noqa: E402

TENSORS = ["token_embd.weight"] + [f"blk.{i}.{t}.weight" for i in (0, 7, 15, 23, 29)
                                   for t in ("attn_q", "attn_v", "attn_output", "ffn_gate", "ffn_down")]  # fmt: skip


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(x: list[float]) -> list[float]:
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        for rank, i in enumerate(order):
            r[i] = float(rank)
        return r

    ra, rb = ranks(a), ranks(b)
    n = len(a)
    ma, mb = sum(ra) / n, sum(rb) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    return cov / (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--work", default=str(ROOT / "build" / "bench-sensitivity"))
    args = ap.parse_args()
    import torch

    from llmopt.api.convert import plan_gguf_file
    from llmopt.eval.perplexity import evaluate, token_windows
    from llmopt.formats.gguf.types import candidate_types
    from llmopt.model import open_model
    from llmopt.model.decoder import Decoder
    from llmopt.plan.gguf_automix import rounded
    from llmopt.plan.sensitivity import cache_path, load

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    src = source_model(work, offgrid=True)
    table_for = work / "costs.gguf"  # never written: its cost table is
    plan, summary = plan_gguf_file(src, target_bpw=5.0, calib=str(DATA / "valid.txt"),
                                   sensitivity_samples=args.samples, output=table_for)  # fmt: skip
    from safetensors import safe_open

    with safe_open(str(cache_path(table_for.resolve())), "pt") as f:
        key = json.loads(f.metadata()["key"])
    costs = load(cache_path(table_for.resolve()), key)
    shapes = {t.gguf_name: t.shape for t in plan.tensors}
    hf_names = {t.gguf_name: t.hf_name for t in plan.tensors}
    with open_model(src) as source:
        tok = source.tokenizer()
        windows = token_windows(tok.encode((DATA / "test.txt").read_text()), 512, args.windows)
        ref = Decoder.from_source(source, torch.float32)
        model = Decoder.from_source(source, torch.float32)
        if model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr():
            model.lm_head.weight = model.embed_tokens.weight  # one tensor, as in the GGUF file
    rows = []
    for name in TENSORS:
        kind = "Q2_K" if "Q2_K" in candidate_types(shapes[name]) else "Q4_0"
        param = model.get_parameter(hf_names[name].removeprefix("model."))
        original = param.data.clone()
        param.data.copy_(rounded(kind, original, costs.importance.get(name)))
        measured = evaluate(model, windows, ref).kl_divergence
        param.data.copy_(original)
        predicted = costs.cost[name][costs.options[name].index(kind)]
        rows.append({"tensor": name, "type": kind, "predicted_kld": predicted, "measured_kld": measured})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(f"{'tensor':28} {'type':5} {'predicted':>10} {'measured':>10} {'ratio':>6}")
    for r in rows:
        print(f"{r['tensor']:28} {r['type']:5} {r['predicted_kld']:>10.5f} {r['measured_kld']:>10.5f} "
              f"{r['predicted_kld'] / max(r['measured_kld'], 1e-12):>6.2f}")
    rho = spearman([r["predicted_kld"] for r in rows], [r["measured_kld"] for r in rows])
    total_p, total_m = sum(r["predicted_kld"] for r in rows), sum(r["measured_kld"] for r in rows)
    print(f"Spearman rank correlation {rho:.3f}; sum predicted {total_p:.5f}, sum measured {total_m:.5f}")
    print(json.dumps({"benchmark": "sensitivity_agreement", "windows": args.windows, "samples": args.samples,
                      "spearman": round(rho, 4), "rows": rows}))  # fmt: skip


if __name__ == "__main__":
    main()
