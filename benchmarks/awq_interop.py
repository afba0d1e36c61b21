"""AWQ (GEMM) checkpoints both ways between llmopt and the maintained `gptqmodel` package.

1. gptqmodel quantizes a small random Llama with its AWQ (its default, symmetric, and asymmetric)
   and saves it; llmopt reads the checkpoint: every linear's dequantized weight must equal
   gptqmodel's own `dequantize_weight()` exactly, and the logits of our model must equal theirs.
2. llmopt quantizes the same model with AWQ (asymmetric and symmetric) and gptqmodel loads the
   checkpoint (its torch AWQ kernel, float32): its logits on a 64-token input must match our
   dequantized model's within 1e-2 (max abs).

The model is 256 wide with two layers: gptqmodel's AWQ clip search takes output channels in
batches of 64. Why a benchmark and not a test, and how to install gptqmodel beside this project:
see benchmarks/gptq_interop.py.

Usage: .venv/bin/python benchmarks/awq_interop.py --gptqmodel-python /tmp/gqvenv/bin/python
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.gptq_interop import DUMP_SNIPPET, our_logits, run  # noqa: E402

QUANTIZE_SNIPPET = r"""
import sys, json, torch
from gptqmodel import GPTQModel, QuantizeConfig
src, out, group, calib, sym = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
ids = json.load(open(calib))
data = [{"input_ids": row, "attention_mask": [1] * len(row)} for row in ids]
options = {"quant_method": "awq", "bits": 4, "group_size": group}
if sym != "default":
    options["sym"] = sym == "sym"
model = GPTQModel.load(src, QuantizeConfig(**options), device="cpu")
model.quantize(data, batch_size=1)
model.save(out)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gptqmodel-python", required=True)
    args = ap.parse_args()
    import torch
    from safetensors.torch import load_file

    from llmopt.cli.app import main as llmopt_main
    from llmopt.model import open_model
    from tests.factories import CORPUS
    from tests.formats.gguf.models import make_wide_hf

    work = Path(tempfile.mkdtemp(prefix="awq-interop-"))
    src = make_wide_hf(work / "src", "llama", layers=2)
    group = 64
    with open_model(src) as s:
        stream = s.tokenizer().encode(CORPUS * 4)
    (work / "calib.json").write_text(json.dumps([stream[i * 64:(i + 1) * 64] for i in range(16)]))
    (work / "calib.txt").write_text(CORPUS * 4)
    probe = stream[1000:1064]
    rows = []

    # 1. gptqmodel writes, llmopt reads
    for sym in ("default", "asym"):
        out = work / f"gm-awq-{sym}"
        run(args.gptqmodel_python, QUANTIZE_SNIPPET, str(src), str(out), str(group), str(work / "calib.json"), sym)
        dump = work / f"{out.name}.safetensors"
        run(args.gptqmodel_python, DUMP_SNIPPET, str(out), str(dump), json.dumps(probe), "AWQ_TORCH")
        theirs = load_file(str(dump))
        worst = 0.0
        with open_model(out) as q:
            assert q.kind == "hf-awq", q.kind
            for name, w in theirs.items():
                if name != "__logits__":
                    worst = max(worst, float((q.load(f"{name}.weight", torch.float32) - w).abs().max()))
        logit_diff = float((our_logits(out, probe) - theirs["__logits__"]).abs().max())
        rows.append({"direction": "gptqmodel -> llmopt", "sym": sym, "max_weight_diff": worst, "max_logit_diff": logit_diff})
        print(json.dumps(rows[-1]), flush=True)

    # 2. llmopt writes, gptqmodel reads
    for sym in ("--asym", "--sym"):
        out = work / f"ours-awq{sym}"
        with contextlib.redirect_stdout(io.StringIO()):  # its --json result: this script prints its own rows
            code = llmopt_main(["--json", "quantize", str(src), "-o", str(out), "--method", "awq", "--group-size",
                                str(group), sym, "--calib", str(work / "calib.txt"), "--nsamples", "16", "--seqlen", "64"])
        assert code == 0
        dump = work / f"{out.name}.safetensors"
        run(args.gptqmodel_python, DUMP_SNIPPET, str(out), str(dump), json.dumps(probe), "AWQ_TORCH")
        theirs = load_file(str(dump))
        ours = our_logits(out, probe)
        worst = 0.0
        with open_model(out) as q:
            for name, w in theirs.items():
                if name != "__logits__":
                    worst = max(worst, float((q.load(f"{name}.weight", torch.float32) - w).abs().max()))
        rows.append({"direction": "llmopt -> gptqmodel", "sym": sym, "max_weight_diff": worst,
                     "max_logit_diff": float((ours - theirs["__logits__"]).abs().max()),
                     "logit_change_vs_source": round(float((ours - our_logits(src, probe)).abs().max()), 4)})
        print(json.dumps(rows[-1]), flush=True)
    ok = all(r["max_weight_diff"] == 0.0 for r in rows) and all(r["max_logit_diff"] < 1e-2 for r in rows)
    print(json.dumps({"benchmark": "awq_interop", "model": "wide-llama-256", "rows": rows, "ok": ok}))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
