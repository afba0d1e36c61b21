"""GPTQ on the real SmolLM2-135M: at 3 bits, g128, GPTQ's perplexity is clearly below RTN's.

A shortened protocol to fit the test budget (16 × 256 calibration tokens from wikitext-2 valid,
perplexity on the first 8 windows of 512 tokens of test.txt); benchmarks/gptq.py runs the full one.
"""

from __future__ import annotations


import pytest

from llmopt.model import open_model
from llmopt.quant.gptq import GPTQConfig
from llmopt.quant.pipeline import QuantizeSpec, quantize_model
from llmopt.quant.rtn import RTNConfig
from tests.factories import write_checkpoint
from tests.quant.smollm2 import perplexity, short_protocol

@pytest.mark.slow
def test_gptq_w3_beats_rtn_w3(smollm2_hf, tmp_path) -> None:
    with open_model(smollm2_hf) as src:
        windows, tokens = short_protocol(src)
        gptq = QuantizeSpec(GPTQConfig(3, 128, True, damp=0.01))
        rtn = QuantizeSpec(RTNConfig(3, 128, True))
        gptq_dir = write_checkpoint(src, gptq, quantize_model(src, gptq, tokens), tmp_path / "gptq")
        rtn_dir = write_checkpoint(src, rtn, quantize_model(src, rtn), tmp_path / "rtn")
    ppl_gptq, ppl_rtn = perplexity(gptq_dir, windows), perplexity(rtn_dir, windows)
    print(f"SmolLM2 w3 g128 sym, 8 windows: GPTQ {ppl_gptq:.2f}, RTN {ppl_rtn:.2f}")
    assert ppl_gptq < 0.8 * ppl_rtn
