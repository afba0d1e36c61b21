"""GPTQ's error feedback onto the i-quant, ternary and FP4 grids (the one grid contract): codes that
llama.cpp's format holds exactly, with less Hessian-weighted error than the grid's own rounding.

(Not on the ternary grids: with llama.cpp's scale d = max|x| nearly every weight of a block rounds to
0 either way, and feeding that error forward does not help; there only exactness is checked.)"""

from __future__ import annotations

import gguf
import pytest
import torch

from llmopt.formats.gguf.blocks import pack
from llmopt.quant.gptq import GPTQConfig, gptq_quantize
from llmopt.quant.grids import GRIDS
from tests.quant.test_gptq_grids import _hessian_error, _problem, gptq_into_gguf, logits_ours_and_llama_cpp


@pytest.mark.parametrize("type_name", ["IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0", "MXFP4", "NVFP4"])
def test_gptq_codes_are_the_grids_and_beat_its_rounding(type_name: str) -> None:
    w, h = _problem()
    grid = GRIDS[type_name]
    qt = gptq_quantize(w, h, GPTQConfig(damp=0.01), type_name, grid=grid).tensor
    assert qt.grid == type_name and qt.shape == tuple(w.shape)
    ours = qt.dequantize()
    theirs = torch.from_numpy(gguf.quants.dequantize(pack(qt), gguf.GGMLQuantizationType[type_name])).reshape(w.shape)
    assert torch.equal(theirs, ours)
    if type_name.startswith("TQ"):
        assert set(qt.codes.unique().tolist()) <= {1, 2, 3}
        return
    gptq_error = _hessian_error(w, ours, h)
    rtn_error = _hessian_error(w, grid.quantize(w).dequantize(), h)
    assert gptq_error < 0.9 * rtn_error, (gptq_error, rtn_error)


def test_pipeline_into_a_gguf_file_that_llama_cpp_runs(tmp_path) -> None:
    """A random 256-wide Llama through GPTQ onto an IQ4_XS plan with MXFP4/NVFP4 overrides: the file
    reads back (gguf's dequantization) as exactly what GPTQ produced, and llama.cpp runs it to our
    decoder's next tokens."""
    from llmopt.model import open_model
    from tests.formats.gguf.llama_cpp_helpers import gguf_types

    out, plan, produced = gptq_into_gguf(tmp_path, "IQ4_XS", [("attn_q", "MXFP4"), ("attn_k", "NVFP4"),
                                                              ("ffn_up", "IQ4_NL")], GPTQConfig(damp=0.01))  # fmt: skip
    assert gguf_types(out) == {t.gguf_name: t.type_name for t in plan.tensors}
    assert {"IQ4_XS", "IQ4_NL", "MXFP4", "NVFP4"} <= {qt.grid for qt in produced.values()}
    with open_model(out) as written:
        for module, qt in produced.items():
            assert torch.equal(written.load(f"{module}.weight"), qt.dequantize()), module
    ids, ours, theirs = logits_ours_and_llama_cpp(out)
    # llama.cpp multiplies with activations rounded to 8 bits (its own kernels, per CPU): close, not equal
    assert (theirs - ours).abs().max() < 0.1 * ours.abs().max()
    assert (theirs.argmax(-1) == ours.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("type_name", ["IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M"])
def test_gptq_onto_a_lattice_grid(type_name: str) -> None:
    """The lattice i-quants round a whole group at once, so within a block GPTQ keeps the block's own
    search; its error still feeds the blocks after it: less Hessian-weighted error than the grid's
    rounding with the same importance (diag H), and codes llama.cpp's format holds exactly."""
    w, h = _problem()
    grid = GRIDS[type_name]
    qt = gptq_quantize(w, h, GPTQConfig(damp=0.01), type_name, grid=grid).tensor
    ours = qt.dequantize()
    theirs = torch.from_numpy(gguf.quants.dequantize(pack(qt), gguf.GGMLQuantizationType[type_name])).reshape(w.shape)
    assert torch.equal(theirs, ours)
    rtn = grid.quantize(w, torch.diagonal(h)).dequantize()
    assert _hessian_error(w, ours, h) < 0.9 * _hessian_error(w, rtn, h)


@pytest.mark.parametrize("type_name", ["Q1_0", "Q2_0"])
def test_gptq_onto_the_one_and_two_bit_grids(type_name: str) -> None:
    """Q1_0 (±d) and Q2_0 ((q - 1)·d) with d fixed per block by llama.cpp's rule: GPTQ's codes are values
    llama.cpp's own dequantizer (to_float) reads back exactly; on Q1_0 with less Hessian-weighted error
    (Q2_0's d = max|x| rounds nearly every weight to 0 either way, as on the ternary grids)."""
    from tests.quant.grids.ggml_reference import ggml_dequantize

    w, h = _problem()
    grid = GRIDS[type_name]
    qt = gptq_quantize(w, h, GPTQConfig(damp=0.01), type_name, grid=grid).tensor
    ours = qt.dequantize()
    assert torch.equal(torch.from_numpy(ggml_dequantize(type_name, pack(qt))), ours)
    if type_name == "Q1_0":
        assert _hessian_error(w, ours, h) < 0.9 * _hessian_error(w, grid.quantize(w).dequantize(), h)
