"""The shortened SmolLM2 quality protocol the slow quant tests share (benchmarks/quality.py runs the
full one): 16 × 256 calibration tokens from wikitext-2 valid, the first 8 windows of 512 tokens of test.txt."""

from __future__ import annotations

from pathlib import Path

import torch

from llmopt.calibration.samples import CalibConfig, calibration_tokens
from llmopt.calibration.text import read_texts
from llmopt.eval.perplexity import evaluate, token_windows
from llmopt.model import open_model
from llmopt.model.decoder import Decoder

DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "wikitext-2"


def short_protocol(src) -> tuple[torch.Tensor, torch.Tensor]:
    """(test windows, calibration tokens) for an open model source."""
    tok = src.tokenizer()
    windows = token_windows(tok.encode((DATA / "test.txt").read_text()[:200_000]), 512, 8)
    cfg = CalibConfig(str(DATA / "valid.txt"), None, 16, 256, 0)
    return windows, calibration_tokens(read_texts(cfg.source), tok.encode, cfg)


def perplexity(model_dir: Path, windows: torch.Tensor) -> float:
    with open_model(model_dir) as src:
        model = Decoder.from_source(src, torch.float32)
    return evaluate(model, windows).perplexity
