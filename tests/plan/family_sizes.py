"""The recommend-vs-llama.cpp file size check every family's size test runs on its tiny model."""

from __future__ import annotations

from pathlib import Path

from llmopt.api import convert_to_gguf, recommend
from tests.formats.gguf.llama_cpp_helpers import llama_quantize


def _q4_k_m(model: str):  # noqa: ANN202 - a recommend Row
    return next(r for r in recommend(mem=8, model=model)["rows"] if r.format == "Q4_K_M")


def assert_recommend_gives_llama_cpp_q4_k_m_size(hf: Path, tmp_path: Path, label: str) -> None:
    """From our F16 GGUF (metadata measured) the whole file to the byte; from the HF directory
    (config only: metadata estimated from the vocabulary) the same tensor bytes."""
    f16 = tmp_path / "f16.gguf"
    convert_to_gguf(hf, f16, "F16")
    written = llama_quantize(f16, tmp_path / "q4_k_m.gguf", "Q4_K_M", nthread=2).stat().st_size
    from_gguf, from_hf = _q4_k_m(str(f16)), _q4_k_m(str(hf))
    print(f"{label} Q4_K_M: llama.cpp {written:,} B, recommend (GGUF) {from_gguf.file_bytes:,} B, "
          f"recommend (HF dir) {from_hf.file_bytes:,} B")
    assert from_gguf.file_bytes == written
    assert from_hf.weights_bytes == from_gguf.weights_bytes
    assert abs(from_hf.file_bytes - written) / written < 0.01
