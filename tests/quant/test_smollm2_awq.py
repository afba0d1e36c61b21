"""AWQ on the real SmolLM2-135M, end to end.

The command users type writes an AWQ checkpoint that inspect, generate and eval read; and at 3
bits, g128, AWQ's scales and clips bring perplexity well below round-to-nearest on the same grid.
A shortened protocol to fit the test budget (16 × 256 calibration tokens from wikitext-2 valid,
the first 8 windows of 512 tokens of test.txt); benchmarks/awq.py runs the full one.
"""

from __future__ import annotations

import json

import pytest

from llmopt.model import open_model
from llmopt.quant.awq import AWQConfig
from llmopt.quant.pipeline import QuantizeSpec, quantize_model
from llmopt.quant.rtn import RTNConfig
from tests.factories import write_checkpoint
from tests.quant.smollm2 import DATA, perplexity, short_protocol

@pytest.mark.slow
def test_awq_checkpoint_from_the_cli_is_read_everywhere(smollm2_hf, llmopt_here, tmp_path) -> None:
    out = tmp_path / "awq"
    r = llmopt_here("quantize", str(smollm2_hf), "--method", "awq", "--calib", str(DATA / "valid.txt"),
                    "--nsamples", "4", "--seqlen", "128", "-o", str(out))  # fmt: skip  (plumbing: a small calibration)
    assert r.returncode == 0, r.stderr
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (qc["quant_method"], qc["version"], qc["bits"], qc["group_size"], qc["zero_point"]) == ("awq", "gemm", 4, 128, True)
    r = llmopt_here("--json", "inspect", str(out))
    assert r.returncode == 0, r.stderr
    assert "awq" in r.stdout
    r = llmopt_here("--json", "generate", str(out), "-p", "The capital of France is", "-n", "8", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    generated = json.loads(r.stdout)
    assert 0 < len(generated["tokens"]) <= 8 and generated["text"].strip()
    test_txt = tmp_path / "test.txt"
    test_txt.write_text((DATA / "test.txt").read_text()[:40_000])
    r = llmopt_here("--json", "eval", str(out), "--data", str(test_txt), "--ref", str(smollm2_hf), "--windows", "4")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["perplexity"] < 1.3 * result["ref_perplexity"]


@pytest.mark.slow
def test_awq_w3_beats_rtn_w3(smollm2_hf, tmp_path) -> None:
    with open_model(smollm2_hf) as src:
        windows, tokens = short_protocol(src)
        awq = QuantizeSpec(AWQConfig(3, 128, sym=False))
        rtn = QuantizeSpec(RTNConfig(3, 128, False))
        awq_dir = write_checkpoint(src, awq, quantize_model(src, awq, tokens), tmp_path / "awq", fmt="dense")
        rtn_dir = write_checkpoint(src, rtn, quantize_model(src, rtn), tmp_path / "rtn", fmt="dense")
    ppl_awq, ppl_rtn = perplexity(awq_dir, windows), perplexity(rtn_dir, windows)
    print(f"SmolLM2 w3 g128 asym, 8 windows: AWQ {ppl_awq:.2f}, RTN {ppl_rtn:.2f}")
    assert ppl_awq < 0.8 * ppl_rtn
