"""Where the wikitext-calibrated GPTQ checkpoint beats the self-calibrated one (issue 4).

Scores three models on the issue's perplexity protocol (wikitext-2 test.txt, ctx 512, 40 windows)
token by token, and again on the same text with wikitext's tokenization artefacts undone
(" @-@ " -> "-", space before punctuation, "= = Heading = =" lines -> markdown headings). The
per-token gap between the two GPTQ checkpoints is split by what the token is: part of a "<unk>",
of an "@-@" marker, of a heading line, a number, punctuation, whitespace or a word. Text that the
model writes itself (`--calib self`) never holds the first three, so their share of the gap is
what no data-free calibration can see.

Run benchmarks/gptq.py first for the two checkpoints:
  python benchmarks/gptq.py --work /tmp/gptqbench --configs gptq-w4-g128-sym-gar gptq-w4-g128-sym-gar-self
  python benchmarks/calib_domain_gap.py --work /tmp/gptqbench
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DATA = ROOT.parent / "shared" / "data" / "wikitext-2"

MARKUP = {"<unk>": re.compile(r"<unk>"), "@-@ marker": re.compile(r"@[-.,]@"),
          "heading line": re.compile(r"^ ?=(?: =)* .* =(?: =)*(?= ?$)", re.M)}
CLASSES = [*MARKUP, "number", "punctuation", "whitespace", "word"]


def detokenize(text: str) -> str:
    """wikitext-2's raw text as ordinary prose: joined "@-@" markers, no space before punctuation or
    after opening brackets, contractions joined, "= = Title = =" lines as markdown headings."""
    text = re.sub(r" @([-.,])@ ", r"\1", text)
    text = re.sub(r" ([.,;:!?)\]])", r"\1", text)
    text = re.sub(r"([(\[]) ", r"\1", text)
    text = re.sub(r" (n't|'s|'re|'ve|'ll|'d|'m)\b", r"\1", text)

    def heading(m: re.Match) -> str:
        return "#" * len(m.group(1).split()) + " " + m.group(2)
    return re.sub(r"^ ?((?:= )+)(.*?)(?: =)+ ?$", heading, text, flags=re.M)


def token_classes(text: str, offsets: list[tuple[int, int]]) -> list[str]:
    """The class of each token: a markup span it overlaps, else what its characters are."""
    spans = {name: [m.span() for m in rx.finditer(text)] for name, rx in MARKUP.items()}
    classes = []
    for start, end in offsets:
        piece = text[start:end].strip()
        name = next((n for n, ss in spans.items() if any(s < end and start < e for s, e in ss)), None)
        if name is None:
            name = ("whitespace" if not piece else "number" if re.search(r"\d", piece)
                    else "punctuation" if re.fullmatch(r"\W+", piece) else "word")
        classes.append(name)
    return classes


def token_nll(model_dir: str, windows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Negative log-likelihood of every scored token (tokens 1..ctx-1 of each window), per text."""
    from llmopt.eval.perplexity import window_log_probs
    from llmopt.model import open_model
    from llmopt.model.decoder import Decoder

    with open_model(model_dir) as src:
        model = Decoder.from_source(src, torch.float32)
    return {kind: torch.cat([-window_log_probs(model, x).gather(-1, x[1:, None])[:, 0] for x in w])
            for kind, w in windows.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default=str(ROOT / "build" / "bench-gptq"), help="benchmarks/gptq.py's --work folder")
    ap.add_argument("--real", default="gptq-w4-g128-sym-gar", help="the checkpoint calibrated on wikitext valid.txt")
    ap.add_argument("--self", dest="self_", default="gptq-w4-g128-sym-gar-self", help="the --calib self checkpoint")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--windows", type=int, default=40)
    args = ap.parse_args()
    work = Path(args.work)
    models = {"fp16": work / "smollm2-f16", "real": work / args.real, "self": work / args.self_}
    missing = [str(p) for p in models.values() if not (p / "config.json").is_file()]
    if missing:
        sys.exit(f"missing checkpoint(s) {', '.join(missing)}: run benchmarks/gptq.py first (see --help)")

    from llmopt.eval.perplexity import token_windows
    from llmopt.model import open_model

    raw = (DATA / "test.txt").read_text()
    texts = {"raw": raw, "detokenized": detokenize(raw)}
    with open_model(str(models["fp16"])) as src:  # the checkpoints keep the source's tokenizer
        encodings = {kind: src.tokenizer().tokenizer.encode(text) for kind, text in texts.items()}
    windows = {kind: token_windows(enc.ids, args.ctx, args.windows) for kind, enc in encodings.items()}
    scored = args.ctx * args.windows
    raw_classes = [c for i, c in enumerate(token_classes(raw, encodings["raw"].offsets[:scored])) if i % args.ctx]
    nll = {(name, kind): values for name, path in models.items() for kind, values in token_nll(str(path), windows).items()}
    ppl = {k: math.exp(v.mean().item()) for k, v in nll.items()}

    print(f"{'text':12} {'fp16':>8} {'real-cal':>9} {'self-cal':>9} {'self vs real':>13}")
    for kind in texts:
        gap = 100 * (ppl["self", kind] / ppl["real", kind] - 1)
        print(f"{kind:12} {ppl['fp16', kind]:8.2f} {ppl['real', kind]:9.2f} {ppl['self', kind]:9.2f} {gap:+12.2f}%")

    diff = nll["self", "raw"] - nll["real", "raw"]
    rows = []
    for c in CLASSES:
        mask = torch.tensor([x == c for x in raw_classes])
        if mask.any():
            rows.append({"class": c, "tokens": int(mask.sum()), "share_of_gap": diff[mask].sum().item() / diff.sum().item(),
                         **{f"nll_{m}": nll[m, "raw"][mask].mean().item() for m in models}})
    print("\nraw text, by token class: mean NLL (nats) and share of the self-vs-real gap")
    print(f"{'class':14} {'tokens':>7} {'fp16':>7} {'real':>7} {'self':>7} {'share':>7}")
    for r in rows:
        print(f"{r['class']:14} {r['tokens']:7d} {r['nll_fp16']:7.3f} {r['nll_real']:7.3f} {r['nll_self']:7.3f} "
              f"{100 * r['share_of_gap']:6.1f}%")
    print(json.dumps({"benchmark": "calib_domain_gap", "real": args.real, "self": args.self_,
                      "perplexity": {f"{m}/{k}": round(v, 3) for (m, k), v in ppl.items()}, "classes": rows}))


if __name__ == "__main__":
    main()
