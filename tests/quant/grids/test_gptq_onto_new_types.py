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


def test_pipeline_into_a_gguf_file_that_llama_cpp_runs(tmp_path) -> None:
    """A random 256-wide Llama through GPTQ onto an IQ4_XS plan with MXFP4/NVFP4 overrides: the file
    reads back (gguf's dequantization) as exactly what GPTQ produced, and llama.cpp runs it to our
    decoder's next tokens."""
    import numpy as np
    from llama_cpp import Llama

    from llmopt.formats.gguf.writer import GGUFWriter, grids_for, plan_gguf
    from llmopt.model import open_model
    from llmopt.model.decoder import Decoder
    from llmopt.quant.pipeline import QuantizeSpec, quantize_model, quantized_modules
    from tests.formats.gguf.llama_cpp_helpers import gguf_types
    from tests.formats.gguf.models import make_wide_hf

    hf = make_wide_hf(tmp_path / "hf", "llama", layers=2)
    out = tmp_path / "gptq-IQ4_XS.gguf"
    produced = {}
    with open_model(hf) as src:
        plan = plan_gguf(src, "IQ4_XS", overrides=[("attn_q", "MXFP4"), ("attn_k", "NVFP4"), ("ffn_up", "IQ4_NL")])
        spec = QuantizeSpec(GPTQConfig(damp=0.01), grids=grids_for(plan), batch_size=2)
        tokens = torch.randint(0, 300, (4, 64), generator=torch.Generator().manual_seed(0))
        with GGUFWriter(src, out, plan, computed=quantized_modules(src, spec)) as writer:
            for block in quantize_model(src, spec, tokens):
                writer.add(block)
                produced.update(block.tensors)
            writer.finish()
    assert gguf_types(out) == {t.gguf_name: t.type_name for t in plan.tensors}
    assert {"IQ4_XS", "IQ4_NL", "MXFP4", "NVFP4"} <= {qt.grid for qt in produced.values()}
    with open_model(out) as written:
        for module, qt in produced.items():
            assert torch.equal(written.load(f"{module}.weight"), qt.dequantize()), module
        ids = written.tokenizer().encode("The quick brown fox jumps over the lazy dog. Pack my box.")
        ours = Decoder.from_source(written)(torch.tensor([ids]))[0].detach()
    llm = Llama(model_path=str(out), n_ctx=64, logits_all=True, verbose=False, n_threads=2)
    llm.eval(ids)
    theirs = torch.tensor(np.asarray(llm.scores[: len(ids)]))
    # llama.cpp multiplies with activations rounded to 8 bits (its own kernels, per CPU): close, not equal
    assert (theirs - ours).abs().max() < 0.1 * ours.abs().max()
    assert (theirs.argmax(-1) == ours.argmax(-1)).float().mean() >= 0.9
