"""The readers under a seeded mutation fuzzer (tests/fuzz.py): 3,000 malformed GGUF files, HF
folders, GPTQ and AWQ checkpoints and imatrix files, each read whole; nothing may escape but llmopt's own
one-line input error, no case may hang (5 s) or allocate beyond 1 GiB. The cases found while
building it are replayed first, so a fixed failure stays fixed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# (reader, file, seed, case) of failures found while the fuzzer was built, replayed every run: the
# imatrix reader on gguf-py's GGUFReader (six sites; it now reads through llmopt's own header
# reader, which checks the container), and a Rust panic in tokenizers on a tokenizer.json.
IMATRIX_FAILURES = [["imatrix", "", 1, i] for i in (1, 14, 27, 40, 53, 66, 105, 118, 157, 170, 183, 196, 222, 235, 248,
                                                     261, 274, 326, 352, 378, 391, 417, 430, 482, 508, 521, 560, 573, 599)]
REGRESSIONS = IMATRIX_FAILURES + [["gptq", "tokenizer.json", 13, 1064]]


@pytest.fixture(scope="module")
def fuzz_sources(tiny_models, tiny_ggufs, tmp_path_factory):
    import llmopt.api as llmopt

    work = tmp_path_factory.mktemp("fuzz")
    gptq = work / "gptq"
    llmopt.quantize(tiny_models("llama"), gptq, method="rtn", bits=4, group_size=32)
    (work / "calib.txt").write_text("The quick brown fox jumps over the lazy dog. " * 200)
    llmopt.quantize(tiny_models("llama"), work / "awq", method="awq", bits=4, group_size=32, calib=str(work / "calib.txt"),
                    nsamples=4, seqlen=32)  # fmt: skip
    llmopt.imatrix(tiny_models("llama"), str(work / "calib.txt"), work / "imatrix.gguf", chunks=4, ctx_size=32)
    return {"gguf": tiny_ggufs("llama", "Q8_0"), "hf": tiny_models("llama"), "gptq": gptq, "awq": work / "awq",
            "imatrix": work / "imatrix.gguf"}


def test_readers_survive_3000_mutations(fuzz_sources, tmp_path):
    args = [f"--{k}={v}" for k, v in fuzz_sources.items()]
    proc = subprocess.run([sys.executable, "-m", "tests.fuzz", str(tmp_path / "work"), *args, "--cases", "3000",
                           "--seed", "0", "--replay", json.dumps(REGRESSIONS)],  # fmt: skip
                          capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[2])
    report = json.loads(proc.stdout)
    print({k: v for k, v in report.items() if k != "failures"})
    assert report["failures"] == [] and proc.returncode == 0
    assert report["cases"] == 3000 + len(REGRESSIONS) and report["read"] > 300 and report["refused"] > 300
