"""SmolLM2 end to end through the calibrated GGUF paths: `convert --method gptq --type Q4_K_M` and
the automatic mix (`--target-size`), each loaded by llama.cpp, generating, and scored against the
float model: both must be closer to it than llama.cpp's own rounding of the same size."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest

from tests.quant.smollm2 import DATA

pytestmark = pytest.mark.slow

CALIB = ["--calib", str(DATA / "valid.txt"), "--nsamples", "16", "--seqlen", "256"]


def _kld(path: Path, ref: Path) -> float:
    from llmopt.api.evaluate import evaluate

    result, _, _ = evaluate(str(path), str(DATA / "test.txt"), ref=str(ref), ctx=512, windows=8)
    return result.kl_divergence


def _generates(path: Path) -> None:
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=128, verbose=False, n_threads=2)
    text = llm("The capital of France is", max_tokens=12, temperature=0)["choices"][0]["text"]
    assert len(text.strip()) > 3, text


def test_gptq_onto_q4_k_m_and_the_automatic_mix(llmopt_here, smollm2_hf: Path, tmp_path: Path) -> None:
    plain = tmp_path / "plain.gguf"
    imatrix = tmp_path / "imatrix.gguf"
    assert llmopt_here("imatrix", smollm2_hf, "--calib", DATA / "valid.txt", "--chunks", "16", "-c", "256",
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

    kld = {p.stem: _kld(p, smollm2_hf) for p in (plain, gptq, auto)}
    assert kld["gptq"] < kld["plain"] and kld["auto"] < kld["plain"], kld
