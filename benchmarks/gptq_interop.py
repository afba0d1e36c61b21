"""GPTQ checkpoints both ways between llmopt and the maintained `gptqmodel` package.

1. gptqmodel quantizes a small model (tiny random Llama, or SmolLM2 with --smollm2) and saves it;
   llmopt reads the checkpoint: every linear's dequantized weight must equal gptqmodel's own
   `dequantize_weight()` exactly.
2. llmopt quantizes the same model (GPTQ, with and without act-order, 3 and 4 bits) and gptqmodel
   loads the checkpoint (torch kernel, float32): its logits on a 64-token input must match our
   dequantized model's within 1e-2 (max abs).

Why a benchmark and not a test: gptqmodel 7.7.0 declares torch>=2.14.1 (this project pins the
torch 2.13.0 CPU build) and twenty-odd dependencies; installing it normally pulls a multi-GB CUDA
torch into CI. It runs fine on torch 2.13 in a side venv that reuses this project's packages:

  python3 -m venv /tmp/gqvenv
  echo "$(.venv/bin/python -c 'import site; print(site.getsitepackages()[0])')" \\
      > "$(/tmp/gqvenv/bin/python -c 'import site; print(site.getsitepackages()[0])')/main_venv.pth"
  /tmp/gqvenv/bin/pip install --no-deps gptqmodel==7.7.0 device-smi logbar tokenicer defuser pypcre \\
      threadpoolctl dill pyarrow datasets torchao pillow

Usage: .venv/bin/python benchmarks/gptq_interop.py --gptqmodel-python /tmp/gqvenv/bin/python [--smollm2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

QUANTIZE_SNIPPET = r"""
import sys, json, torch
from gptqmodel import GPTQModel, QuantizeConfig
src, out, bits, group, desc_act, calib, sym = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1", sys.argv[6], sys.argv[7] == "1"
ids = json.load(open(calib))
data = [{"input_ids": row, "attention_mask": [1] * len(row)} for row in ids]
model = GPTQModel.load(src, QuantizeConfig(bits=bits, group_size=group, desc_act=desc_act, sym=sym), device="cpu")
model.quantize(data, batch_size=1)
model.save(out)
"""

DUMP_SNIPPET = r"""
import sys, json, torch
from gptqmodel import GPTQModel, BACKEND
from safetensors.torch import save_file
path, out, ids = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
backend = BACKEND[sys.argv[4]] if len(sys.argv) > 4 else BACKEND.TORCH
# its torch kernel is built for float16; the checkpoint's scales are float16 values, so casting
# the loaded model to float32 loses nothing and gives float32 compute
model = GPTQModel.load(path, device="cpu", backend=backend, dtype=torch.float16)
model.model.to(torch.float32)
weights = {}
for name, m in model.model.named_modules():
    if hasattr(m, "dequantize_weight") and hasattr(m, "qweight"):
        weights[name] = m.dequantize_weight().t().contiguous().float()  # [out, in]
with torch.no_grad():
    logits = model.model(torch.tensor([ids])).logits[0].float()
weights["__logits__"] = logits.contiguous()
save_file(weights, out)
"""


def run(python: str, snippet: str, *args: str) -> None:
    env = {**os.environ, "GPTQMODEL_CPU_WORKERS": "2"}  # its default (cores/2) is refused on 2 cores
    r = subprocess.run([python, "-c", snippet, *args], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"gptqmodel step failed:\n{r.stderr[-4000:]}")


def our_logits(path: Path, ids: list[int]):
    import torch

    from llmopt.model import open_model
    from llmopt.model.decoder import Decoder

    with open_model(path) as src, torch.no_grad():
        return Decoder.from_source(src, torch.float32)(torch.tensor([ids]))[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gptqmodel-python", required=True)
    ap.add_argument("--smollm2", action="store_true", help="Use SmolLM2-135M instead of a tiny random Llama.")
    args = ap.parse_args()
    import torch
    from safetensors.torch import load_file

    from llmopt.cli.app import main as llmopt_main
    from llmopt.model import open_model
    from tests.factories import CORPUS, make_tiny_hf

    work = Path(tempfile.mkdtemp(prefix="gptq-interop-"))
    if args.smollm2:
        from llmopt.model.embedded import smollm2_gguf

        src = work / "src"
        assert llmopt_main(["convert", str(smollm2_gguf()), "--to", "hf", "-o", str(src)]) == 0
        group = 32
    else:
        src = make_tiny_hf(work / "src", "llama", dtype=torch.float16, layers=2)
        group = 32
    with open_model(src) as s:
        tok = s.tokenizer()
        stream = tok.encode(CORPUS * 4)
    calib = [stream[i * 64:(i + 1) * 64] for i in range(16)]
    (work / "calib.json").write_text(json.dumps(calib))
    (work / "calib.txt").write_text(CORPUS * 4)
    probe = stream[1000:1064]
    rows = []

    # 1. gptqmodel writes, llmopt reads
    for bits, desc_act, sym in ((4, False, True), (4, True, True), (3, False, True), (3, True, True), (8, False, True),
                                (2, False, True), (4, False, False)):
        out = work / f"gm-w{bits}-{int(desc_act)}-{int(sym)}"
        run(args.gptqmodel_python, QUANTIZE_SNIPPET, str(src), str(out), str(bits), str(group), str(int(desc_act)),
            str(work / "calib.json"), str(int(sym)))
        dump = work / f"{out.name}.safetensors"
        run(args.gptqmodel_python, DUMP_SNIPPET, str(out), str(dump), json.dumps(probe))
        theirs = load_file(str(dump))
        worst = 0.0
        with open_model(out) as q:
            for name, w in theirs.items():
                if name == "__logits__":
                    continue
                mine = q.load(f"{name}.weight", torch.float32)
                worst = max(worst, float((mine - w).abs().max()))
        logit_diff = float((our_logits(out, probe) - theirs["__logits__"]).abs().max())
        rows.append({"direction": "gptqmodel -> llmopt", "bits": bits, "desc_act": desc_act, "sym": sym,
                     "max_weight_diff": worst, "max_logit_diff": logit_diff})
        print(json.dumps(rows[-1]), flush=True)

    # 2. llmopt writes, gptqmodel reads. Symmetric only: gptqmodel refuses every asymmetric v1
    # checkpoint whose meta.quantizer is not gptqmodel >= 0.9 (AutoGPTQ's zero-point overflow); ours
    # keep zero points >= 1 so they cannot overflow, and direction 1 checks asymmetric reading.
    for bits, extra in ((4, []), (4, ["--act-order"]), (3, []), (3, ["--act-order"]), (8, []), (2, [])):
        out = work / f"ours-w{bits}-{'-'.join(extra) or 'plain'}"
        code = llmopt_main(["--json", "quantize", str(src), "-o", str(out), "--bits", str(bits), "--group-size", str(group),
                            "--calib", str(work / "calib.txt"), "--nsamples", "16", "--seqlen", "64", *extra])
        assert code == 0
        dump = work / f"{out.name}.safetensors"
        run(args.gptqmodel_python, DUMP_SNIPPET, str(out), str(dump), json.dumps(probe))
        theirs = load_file(str(dump))
        ours = our_logits(out, probe)
        diff = float((ours - theirs["__logits__"]).abs().max())
        vs_source = float((ours - our_logits(src, probe)).abs().max())  # sanity: quantization did change them
        rows.append({"direction": "llmopt -> gptqmodel", "bits": bits, "options": " ".join(extra), "max_logit_diff": diff,
                     "logit_change_vs_source": round(vs_source, 4)})
        print(json.dumps(rows[-1]), flush=True)
    ok = all(r.get("max_weight_diff", 0.0) == 0.0 for r in rows) and all(r["max_logit_diff"] < 1e-2 for r in rows)
    print(json.dumps({"benchmark": "gptq_interop", "model": "smollm2" if args.smollm2 else "tiny-llama", "rows": rows, "ok": ok}))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
