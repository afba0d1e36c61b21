"""The Python API alone (no CLI) does what the commands do: quantize -> write -> load -> generate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import llmopt.api as llmopt
from llmopt.errors import OptionError
from tests.factories import CORPUS


def test_quantize_write_load_generate(tiny_models, tmp_path: Path) -> None:
    calib = tmp_path / "calib.txt"
    calib.write_text(CORPUS)
    blocks = []
    result = llmopt.quantize(tiny_models("llama"), tmp_path / "gptq", method="gptq", bits=4, group_size=32,
                             calib=str(calib), nsamples=4, seqlen=32, on_block=lambda b, n: blocks.append((b.layer, n)))
    assert blocks == [(0, 2), (1, 2)] and result.output == (tmp_path / "gptq").resolve()
    qcfg = json.loads((result.output / "config.json").read_text())["quantization_config"]
    assert (qcfg["bits"], qcfg["group_size"], qcfg["meta"]["method"]) == (4, 32, "gptq")

    model = llmopt.load(result.output, keep_quantized=False)
    out = llmopt.generate(model, "The quick brown fox", max_tokens=12, ignore_eos=True)
    assert len(out.token_ids) == 12 and out.text
    again = llmopt.generate(result.output, "The quick brown fox", max_tokens=12, ignore_eos=True, keep_quantized=False)
    assert again.token_ids == out.token_ids  # a path or a loaded model: the same run

    gguf = llmopt.convert_to_gguf(result.output, tmp_path / "q8.gguf", "Q8_0")
    assert gguf["types"]["Q8_0"] > 0 and llmopt.inspect(gguf["output"])["format"] == "gguf"
    res, gates, summary = llmopt.evaluate(gguf["output"], calib, ref=result.output, ctx=32, windows=2, min_top1=0)
    assert summary["passed"] and gates[0].name == "top1_agreement_pct" and res.kl_divergence is not None


def test_library_errors_name_fields(tiny_models, tmp_path: Path) -> None:
    with pytest.raises(OptionError, match="`bits` 9: choose 2 to 8"):
        llmopt.quantize(tiny_models("llama"), tmp_path / "x", bits=9)
    with pytest.raises(OptionError) as info:
        llmopt.quantize(tiny_models("llama"), tmp_path / "x", method="rtn", act_order=True)
    assert info.value.fields == ["act_order", "group_aware", "static_groups", "refit_scales", "gptaq", "method"]
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_smollm2_through_the_api(smollm2_hf: Path, tmp_path: Path) -> None:
    """The real model: GPTQ 4-bit on wikitext, written, loaded (dequantized by default: it fits; packed when
    asked), generating, and close to the
    fp16 model on held-out text (top-1 agreement and KL, from the API's evaluate)."""
    data = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext-2"
    result = llmopt.quantize(smollm2_hf, tmp_path / "gptq", method="gptq", bits=4, group_size=64,
                             calib=str(data / "valid.txt"), nsamples=8, seqlen=128)
    assert not any(type(m).__name__ == "GroupIntLinear" for m in llmopt.load(result.output).model.modules())  # fits
    packed = llmopt.load(result.output, keep_quantized=True)  # 4-bit layers as bit planes (float32 math)
    assert any(type(m).__name__ == "GroupIntLinear" for m in packed.model.modules())
    out = llmopt.generate(packed, "The capital of France is", max_tokens=16, ignore_eos=True)
    assert len(out.token_ids) == 16 and out.text.strip()
    res, gates, _ = llmopt.evaluate(result.output, data / "test.txt", ref=smollm2_hf, ctx=128, windows=4, min_top1=70)
    assert all(g.passed for g in gates), [g.line() for g in gates]
    assert res.kl_divergence < 0.5 and res.ppl_increase_pct < 25
