"""GPTQ on the real SmolLM2-135M: at 3 bits, g128, GPTQ's perplexity is clearly below RTN's.

A shortened protocol to fit the test budget (16 × 256 calibration tokens from wikitext-2 valid,
perplexity on the first 8 windows of 512 tokens of test.txt); benchmarks/gptq.py runs the full one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llmopt.calibration.samples import CalibConfig, calibration_tokens
from llmopt.calibration.text import read_texts
from llmopt.eval.perplexity import evaluate, token_windows
from llmopt.model import open_model
from llmopt.model.decoder import Decoder
from llmopt.quant.gptq import GPTQConfig
from llmopt.quant.pipeline import QuantizeSpec, quantize_model
from llmopt.quant.rtn import RTNConfig
from tests.factories import write_checkpoint

DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "wikitext-2"


def _ppl(model_dir: Path, windows: torch.Tensor) -> float:
    with open_model(model_dir) as src:
        model = Decoder.from_source(src, torch.float32)
    return evaluate(model, windows).perplexity


@pytest.mark.slow
def test_gptq_w3_beats_rtn_w3(smollm2_hf, tmp_path) -> None:
    with open_model(smollm2_hf) as src:
        tok = src.tokenizer()
        windows = token_windows(tok.encode((DATA / "test.txt").read_text()[:200_000]), 512, 8)
        cfg = CalibConfig(str(DATA / "valid.txt"), None, 16, 256, 0)
        tokens = calibration_tokens(read_texts(cfg.source), tok.encode, cfg)
        gptq = QuantizeSpec(GPTQConfig(3, 128, True, damp=0.01))
        rtn = QuantizeSpec(RTNConfig(3, 128, True))
        gptq_dir = write_checkpoint(src, gptq, quantize_model(src, gptq, tokens), tmp_path / "gptq")
        rtn_dir = write_checkpoint(src, rtn, quantize_model(src, rtn), tmp_path / "rtn")
    ppl_gptq, ppl_rtn = _ppl(gptq_dir, windows), _ppl(rtn_dir, windows)
    print(f"SmolLM2 w3 g128 sym, 8 windows: GPTQ {ppl_gptq:.2f}, RTN {ppl_rtn:.2f}")
    assert ppl_gptq < 0.8 * ppl_rtn
