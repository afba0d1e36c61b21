"""Self-speculative decoding against plain decoding, on SmolLM2-135M float32 on CPU, in one run.

The issue's setting: a 256-token continuation prompt from wikitext-2's test text, 128 new tokens,
temperature 0, EOS ignored. For each `--num-draft` K: the skip-set search as `generate
--self-speculative` runs it (its set, its predicted speed-up and whether it would use it), then
plain and self-speculative decoding with that set, alternating, `--repeats` times each (best run
counts: the least disturbed by other work on the machine), with the same-text check.

Then the sweep that shows what limits it: the search's greedy path continued to larger sets (one
longer search), and each set of `--sweep-sizes` layers decoded with the first K. Per row:
fraction of layers skipped, measured acceptance, tokens per target forward, speed-up, and the
ceiling, the speed-up that set would reach with every draft accepted,
(K + 1) * T / (K * draft + V), from the search's measured step (T), head and verify (V) times;
and the bound if verifying cost no more than one plain step, tokens per forward * T / (K * draft
+ T): what the draft side alone allows, whatever the verification costs on the machine.

Prints a table and one JSON line. Decode rate is the runtime's own (tokens after the first, per
second); the search's time is reported apart (it runs once per prompt, before the prefill).

Usage: python benchmarks/self_speculative.py [--threads 2] [--num-draft 1,2,3] [--repeats 2]
       [--prompt-tokens 256] [--new-tokens 128] [--sweep-sizes 1,2,4,6,8,12] [--sweep-budget 60]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

WIKITEXT = Path("/work/shared/data/wikitext-2/test.txt")


def decode(generator, ids, new_tokens):
    return generator.generate(ids, new_tokens, ignore_eos=True)


def best_of(runs):
    """The run with the highest decode rate."""
    return max(runs, key=lambda r: r.metrics.tokens_per_s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--num-draft", default="1,2,3", help="comma-separated K values")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--sweep-sizes", default="1,2,4,6,8,12", help="skip-set sizes to decode with (empty: no sweep)")
    ap.add_argument("--sweep-budget", type=float, default=60.0, help="seconds for the longer search of the sweep")
    args = ap.parse_args()

    from llmopt.model.embedded import smollm2_gguf
    from llmopt.runtime.generate import Generator
    from llmopt.runtime.self_speculative import LayerSkipDraft
    from llmopt.runtime.skip_search import search_skip_layers
    from llmopt.runtime.weights import load_model, set_threads

    set_threads(args.threads)
    loaded = load_model(str(smollm2_gguf()), "float32", "cpu", quantized=False)  # dequantized: the fp32 model
    model, tok = loaded.model, loaded.tokenizer
    ids = tok.encode(WIKITEXT.read_text(encoding="utf-8"))[:args.prompt_tokens]
    layers = model.arch.num_layers
    plain_gen = Generator(model, tok)

    results: dict = {"model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to float32)", "threads": args.threads,
                     "prompt_tokens": len(ids), "new_tokens": args.new_tokens, "layers": layers, "runs": []}
    plain_runs = []
    rows = []
    for k in (int(x) for x in args.num_draft.split(",")):
        choice = search_skip_layers(model, ids, num_draft=k)
        spec_gen = Generator(model, tok, LayerSkipDraft(model, choice.skip), num_draft=k)
        spec_runs = []
        for _ in range(args.repeats):
            plain_runs.append(decode(plain_gen, ids, args.new_tokens))
            spec_runs.append(decode(spec_gen, ids, args.new_tokens))
        spec = best_of(spec_runs)
        row = {"num_draft": k, "skip": list(choice.skip), "searched_s": round(choice.seconds, 2),
               "predicted_speedup": round(choice.predicted_speedup, 3), "search_would_use_it": choice.pays_off,
               "spec_tok_s": round(spec.metrics.tokens_per_s, 2), "acceptance": round(spec.metrics.acceptance_rate or 0.0, 4),
               "tokens_per_forward": round(len(spec.token_ids) / max(spec.metrics.target_forwards, 1), 3),
               "text": spec.text, "tokens": spec.token_ids, "step_ms": round(choice.step_ms, 2), "head_ms": round(choice.head_ms, 2),
               "verify_ms": round(choice.verify_ms, 2)}
        rows.append(row)
        print(f"K={k}: searched {row['searched_s']} s -> skip {row['skip']} (predicted {row['predicted_speedup']}x)", flush=True)
    plain = best_of(plain_runs)  # over every K's alternating runs
    plain_rate = plain.metrics.tokens_per_s
    for row in rows:
        text, tokens = row.pop("text"), row.pop("tokens")
        row.update(plain_tok_s=round(plain_rate, 2), speedup=round(row["spec_tok_s"] / plain_rate, 3),
                   identical_text=text == plain.text and tokens == plain.token_ids)
    results["runs"] = rows

    print("\n| K | skip set | plain tok/s | self-spec tok/s | speed-up | acceptance | tok/forward | predicted | "
          "search s | same text |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['num_draft']} | {','.join(map(str, r['skip']))} | {r['plain_tok_s']} | {r['spec_tok_s']} | "
              f"{r['speedup']}x | {100 * r['acceptance']:.1f}% | {r['tokens_per_forward']} | {r['predicted_speedup']}x | "
              f"{r['searched_s']} | {'yes' if r['identical_text'] else 'NO'} |")
    print(f"\nmeasured: full step T {rows[0]['step_ms']} ms, LM head {rows[0]['head_ms']} ms, "
          f"verify of K+1={rows[0]['num_draft'] + 1} tokens {rows[0]['verify_ms']} ms")

    sizes = [int(x) for x in args.sweep_sizes.split(",") if x.strip()]
    if sizes:
        k = rows[0]["num_draft"]
        path = search_skip_layers(model, ids, num_draft=k, patience=layers, budget=args.sweep_budget)
        sets = {len(r["skip"]): r for r in path.rounds}
        step, head, verify = path.step_ms, path.head_ms, path.verify_ms
        sweep = []
        for size in sizes:
            if size not in sets:
                continue
            skip = sets[size]["skip"]
            run = decode(Generator(model, tok, LayerSkipDraft(model, skip), num_draft=k), ids, args.new_tokens)
            draft = head + (layers - size) / layers * (step - head)
            sweep.append({"skipped": size, "fraction": round(size / layers, 3), "skip": skip,
                          "window_acceptance": sets[size]["acceptance"],
                          "acceptance": round(run.metrics.acceptance_rate or 0.0, 4),
                          "tokens_per_forward": round(len(run.token_ids) / max(run.metrics.target_forwards, 1), 3),
                          "tok_s": round(run.metrics.tokens_per_s, 2),
                          "speedup": round(run.metrics.tokens_per_s / plain_rate, 3),
                          "ceiling": round((k + 1) * step / (k * draft + verify), 3),
                          "free_verify_bound": round(len(run.token_ids) / max(run.metrics.target_forwards, 1) * step
                                                     / (k * draft + step), 3),
                          "identical_text": run.token_ids == plain.token_ids})
        results["sweep"] = {"num_draft": k, "step_ms": round(step, 2), "head_ms": round(head, 2),
                            "verify_ms": round(verify, 2), "search_s": round(path.seconds, 2), "rows": sweep}
        print(f"\nSweep (K={k}; skip sets from the greedy search's path, {path.seconds:.1f} s):")
        print("| layers skipped | fraction | acceptance (window) | acceptance | tok/forward | tok/s | speed-up | "
              "ceiling at 100% | bound if V = T | same text |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in sweep:
            print(f"| {r['skipped']} ({','.join(map(str, r['skip']))}) | {r['fraction']} | "
                  f"{100 * r['window_acceptance']:.1f}% | {100 * r['acceptance']:.1f}% | {r['tokens_per_forward']} | "
                  f"{r['tok_s']} | {r['speedup']}x | {r['ceiling']}x | {r['free_verify_bound']}x | "
                  f"{'yes' if r['identical_text'] else 'NO'} |")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
