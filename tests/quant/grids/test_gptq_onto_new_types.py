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
from tests.quant.test_gptq_grids import _hessian_error, _problem


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
