"""SmolLM2 end to end through the calibrated GGUF paths: `convert --method gptq --type Q4_K_M` and
the automatic mix (`--target-size`), each loaded by llama.cpp and generating; GPTQ's file is closer
to the float model than plain rounding of the same types.

Functional tests on SmolLM2 itself, with a small calibration. Its weights sit on a Q4_1 grid, so the
automatic mix at Q4_K_M's size finds the lossless grid (KL ~2e-6 measured) and says nothing about
quality here: that claim is measured on the off-grid reference model (benchmarks/, docs/gguf.md)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest

from tests.quant.smollm2 import DATA

pytestmark = pytest.mark.slow

CALIB = ["--calib", str(DATA / "valid.txt"), "--nsamples", "8", "--seqlen", "128"]


def _kld(path: Path, ref: Path) -> float:
    from llmopt.api.evaluate import evaluate

    result, _, _ = evaluate(str(path), str(DATA / "test.txt"), ref=str(ref), ctx=256, windows=8)
    return result.kl_divergence


def _generates(path: Path) -> None:
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=128, verbose=False, n_threads=2)
    text = llm("The capital of France is", max_tokens=12, temperature=0)["choices"][0]["text"]
    assert len(text.strip()) > 3, text


def test_gptq_onto_q4_k_m_and_the_automatic_mix(llmopt_here, smollm2_hf: Path, tmp_path: Path) -> None:
    plain = tmp_path / "plain.gguf"
    imatrix = tmp_path / "imatrix.gguf"
    assert llmopt_here("imatrix", smollm2_hf, "--calib", DATA / "valid.txt", "--chunks", "8", "-c", "128",
                       "-o", imatrix).returncode == 0  # fmt: skip
    assert llmopt_here("convert", smollm2_hf, "--to", "gguf", "--type", "Q4_K_M", "--imatrix", imatrix,
                       "-o", plain).returncode == 0  # fmt: skip

    gptq = tmp_path / "gptq.gguf"
    done = llmopt_here("convert", smollm2_hf, "--to", "gguf", "--type", "Q4_K_M", "--method", "gptq", *CALIB,
                       "-o", gptq, "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    types = lambda p: {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(p)).tensors}  # noqa: E731
    assert types(gptq) == types(plain)
    assert abs(gptq.stat().st_size - plain.stat().st_size) < 4096  # the same data; the header records the method
    _generates(gptq)

    auto = tmp_path / "auto.gguf"
    target = plain.stat().st_size
    done = llmopt_here("convert", smollm2_hf, "--to", "gguf", "--target-size", str(target), *CALIB,
                       "--sensitivity-samples", "2", "-o", auto, "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert auto.stat().st_size <= target and result["automix"]["predicted_kld"] > 0
    _generates(auto)

    kld = {p.stem: _kld(p, smollm2_hf) for p in (plain, gptq)}
    print(f"SmolLM2 Q4_K_M KL to the float model (ctx 256, 8 windows): {kld}")
    assert kld["gptq"] < 0.8 * kld["plain"], kld
