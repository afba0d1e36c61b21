"""Calibration in and out of its domain (issue 47): RTN, GPTQ and AWQ at w4 g128, each calibrated on
one source, scored on prose, code and literary text.

Scoring texts (none of them calibration text):
  prose     wikitext-2 test.txt (../shared/data)
  code      this Python's own standard library source (PSF licence; the files in CODE_MODULES)
  literary  the "songs-poems", "art" and "wisdom" files of Debian's `fortunes` package (verse and
            quotations; fetched with `apt-get download fortunes` when not given with --literary)
Calibration sources: `self` (llmopt's default: documents the model writes from random first tokens)
and wikitext-2 valid.txt; 128 × 512 tokens, seed 0 unless --seed. Each output is scored by one `llmopt eval` per text against the float model
(ctx 512, 40 windows): perplexity, KL divergence, top-1 agreement.

  python benchmarks/calib_domains.py --offgrid
  python benchmarks/calib_domains.py --offgrid --methods --gguf-types Q4_K_M --calibs self  # GGUF rows only
  python benchmarks/calib_domains.py --offgrid --extra gptq-self-random=/tmp/old/gptq  # outputs made elsewhere
  python benchmarks/calib_domains.py --offgrid --methods rtn gptq --calibs wikitext --damps 0.1 0.3  # GPTQ's damping
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.quality import DATA, kl_scores, run_llmopt, source_model, timed  # noqa: E402

CODE_MODULES = ("argparse.py", "json/decoder.py", "json/encoder.py", "collections/__init__.py", "difflib.py",
                "textwrap.py", "csv.py", "heapq.py", "statistics.py", "fractions.py", "shutil.py", "tempfile.py")
FORTUNE_FILES = ("songs-poems", "art", "wisdom")
NSAMPLES, SEQLEN = 128, 512  # calibration tokens of every method (the imatrix: as many chunks of as many)
METHODS = {
    "rtn": ["--method", "rtn", "--bits", "4", "--group-size", "128", "--asym"],
    "gptq": ["--method", "gptq", "--bits", "4", "--group-size", "128", "--asym"],
    "awq": ["--method", "awq", "--bits", "4", "--group-size", "128", "--asym"],
}


def code_text(work: Path) -> Path:
    """The standard library modules in CODE_MODULES, concatenated in that order."""
    out = work / "text-code.txt"
    lib = Path(sysconfig.get_paths()["stdlib"])
    out.write_text("\n\n".join((lib / m).read_text() for m in CODE_MODULES))
    return out


def literary_text(work: Path, given: Path | None) -> Path:
    """FORTUNE_FILES of Debian's fortunes package as one text, the "%" separators as blank lines."""
    if given is not None:
        return given
    out = work / "text-literary.txt"
    root = work / "fortunes-deb"
    if not (root / "usr/share/games/fortunes").is_dir():
        root.mkdir(parents=True, exist_ok=True)
        subprocess.run(["apt-get", "download", "fortunes"], cwd=root, check=True, capture_output=True)
        deb = next(root.glob("fortunes_*.deb"))
        subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    pieces = []
    for name in FORTUNE_FILES:
        text = (root / "usr/share/games/fortunes" / name).read_text(errors="replace")
        pieces += [p.strip("\n") for p in text.split("\n%\n") if p.strip()]
    out.write_text("\n\n".join(pieces) + "\n")
    return out


def calib_source(calib: str) -> str:
    """The `--calib` value of a calibration name: self-written text, or wikitext-2 valid.txt."""
    return "self" if calib == "self" else str(DATA / "valid.txt")


def gguf_files(src: Path, work: Path, gguf_type: str, calib: str, seed: int) -> list[tuple[str, float | None, str]]:
    """(name, seconds, path) of three GGUF files from one calibration, 128 × 512 tokens, made unless present:
    llama.cpp's way (an imatrix over as many chunks, self-written ones seed 0's, then the plain `gguf_type`
    mix), `convert --method gptq` onto the same mix, and the automatic mix at the imatrix file's size
    (`--target-size`, its 32 sensitivity samples from the same calibration) rounded by GPTQ."""
    text = calib_source(calib)
    made = []
    imatrix, plain = work / f"domains-imatrix-{calib}-s{seed}.gguf", work / f"domains-{gguf_type}-imatrix-{calib}-s{seed}.gguf"
    gptq = work / f"domains-{gguf_type}-gptq-{calib}-s{seed}.gguf"
    automix = work / f"domains-{gguf_type}-automix-{calib}-s{seed}.gguf"
    calibrated = ["--calib", text, "--nsamples", str(NSAMPLES), "--seqlen", str(SEQLEN), "--seed", str(seed)]
    steps = {plain: lambda: [["imatrix", str(src), "--calib", text, "--chunks", str(NSAMPLES), "-c", str(SEQLEN),
                              "-o", str(imatrix), "--force"],
                             ["convert", str(src), "--to", "gguf", "--type", gguf_type, "--imatrix", str(imatrix), "-o",
                              str(plain), "--force"]],
             gptq: lambda: [["convert", str(src), "--to", "gguf", "--type", gguf_type, "--method", "gptq", *calibrated,
                             "-o", str(gptq), "--force"]],
             automix: lambda: [["convert", str(src), "--to", "gguf", "--target-size", str(plain.stat().st_size),
                                "--method", "gptq", *calibrated, "-o", str(automix), "--force"]]}
    for path, commands in steps.items():  # in order: the automatic mix's target is the imatrix file's size
        seconds = None
        if not path.is_file():
            seconds = sum(timed([sys.executable, "-m", "llmopt.cli.app", *c])["seconds"] for c in commands())
            print(f"{path.name}: {seconds} s", flush=True)
        made.append((path.name.removeprefix("domains-").removesuffix(f"-s{seed}.gguf"), seconds, str(path)))
    return made


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=ROOT / "build" / "bench-autoround")
    ap.add_argument("--offgrid", action="store_true", help="the off-grid reference model (../shared/tools)")
    ap.add_argument("--methods", nargs="*", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--gguf-types", nargs="*", default=[], metavar="TYPE",
                    help="also GGUF files of these types: llama.cpp's way (an imatrix of the calibration, the plain "
                         "mix), `convert --method gptq` and the automatic mix at the imatrix file's size, all from "
                         "the same calibration")
    ap.add_argument("--calibs", nargs="+", default=["self", "wikitext"], choices=["self", "wikitext"])
    ap.add_argument("--extra", nargs="*", default=[], metavar="NAME=DIR", help="outputs made elsewhere, scored too")
    ap.add_argument("--literary", type=Path, help="a literary text instead of the fortunes files")
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--damps", nargs="*", type=float, default=[],
                    help="also GPTQ at these --damp values (regularization out of domain; the default is 0.01)")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    src = source_model(args.work, args.offgrid)
    texts = {"prose": DATA / "test.txt", "code": code_text(args.work), "literary": literary_text(args.work, args.literary)}
    outputs, runs = {}, {}
    for calib in args.calibs:
        variants = [(m, m, []) for m in args.methods] + [("gptq", f"gptq-d{d:g}", ["--damp", str(d)]) for d in args.damps]
        for method, label, extra in variants:
            if method == "rtn" and calib != args.calibs[0]:
                continue  # RTN reads no calibration
            name = "rtn" if method == "rtn" else f"{label}-{calib}"
            out = args.work / f"domains-{name}-s{args.seed}"
            options = METHODS[method] + extra + ([] if method == "rtn" else ["--calib", calib_source(calib)])
            if not (out / "config.json").is_file():
                runs[name] = run_llmopt(str(src), str(out), options, NSAMPLES, SEQLEN, args.seed)["seconds"]
                print(f"{name}: {runs[name]} s", flush=True)
            outputs[name] = str(out)
        for gguf_type in args.gguf_types:
            for name, seconds, path in gguf_files(src, args.work, gguf_type, calib, args.seed):
                runs[name], outputs[name] = seconds, path
    outputs.update(dict(e.split("=", 1) for e in args.extra))
    rows = {name: {"seconds": runs.get(name)} for name in outputs}
    for domain, path in texts.items():
        for name, score in zip(outputs, kl_scores(list(outputs.values()), str(src), args.windows, path)):
            rows[name][domain] = {"ppl": round(score["perplexity"], 3), "kl": round(score["kl_divergence"], 5),
                                  "top1": round(100 * score["top1_agreement"], 2), "float_ppl": round(score["ref_perplexity"], 3)}
    print_table(rows, list(texts))
    print(json.dumps({"benchmark": "calib_domains", "model": str(src), "seed": args.seed,
                      "texts": {k: str(v) for k, v in texts.items()}, "rows": rows}))


def print_table(rows: dict, domains: list[str]) -> None:
    """Perplexity (its change against RTN) and KL per domain, one row per output."""
    head = "".join(f" {d + ' ppl':>16} {'vs RTN':>7} {'KL':>8}" for d in domains)
    print(f"\n{'output':24}{head} {'seconds':>8}")
    for name, r in rows.items():
        cells = ""
        for d in domains:
            gain = f"{100 * (r[d]['ppl'] / rows['rtn'][d]['ppl'] - 1):+6.2f}%" if "rtn" in rows else ""
            cells += f" {r[d]['ppl']:16.3f} {gain:>7} {r[d]['kl']:8.5f}"
        print(f"{name:24}{cells} {r['seconds'] or '':>8}")
    first = next(iter(rows.values()))
    print("float" + " " * 19 + "".join(f" {first[d]['float_ppl']:16.3f} {'':7} {'':8}" for d in domains))


if __name__ == "__main__":
    main()
