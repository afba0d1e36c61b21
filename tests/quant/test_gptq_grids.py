"""GPTQ onto GGUF grids (the one grid contract): codes that llama.cpp's own format holds exactly, with
less Hessian-weighted error than the grid's plain rounding, through the pipeline into a GGUF file."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from llmopt.formats.gguf.blocks import pack
from llmopt.model import open_model
from llmopt.quant.gptq import GPTQConfig, gptq_quantize
from llmopt.quant.grids import GRIDS

TYPES = ("Q4_0", "Q8_0", "Q4_K", "Q6_K")


def _problem(rows: int = 48, cols: int = 512, tokens: int = 4096, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights and the Hessian 2/N XᵀX of correlated inputs with a few loud channels (as LLMs have)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.02 * (1 + torch.rand(rows, cols, generator=g) ** 8 * 4)
    mix = torch.randn(cols, cols, generator=g) / cols**0.5 + torch.eye(cols)
    x = torch.randn(tokens, cols, generator=g) @ mix
    x[:, torch.randperm(cols, generator=g)[:8]] *= 6
    return w, 2 * x.t() @ x / tokens


def _hessian_error(w: torch.Tensor, q: torch.Tensor, h: torch.Tensor) -> float:
    d = (w - q).double()
    return float(torch.einsum("ri,ij,rj->", d, h.double(), d))


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("order", ["natural", "group_aware", "act_order_static"])
def test_gptq_codes_are_the_grids_and_beat_its_rounding(type_name: str, order: str) -> None:
    w, h = _problem()
    grid = GRIDS[type_name]
    cfg = GPTQConfig(damp=0.01, group_aware=order == "group_aware", act_order=order == "act_order_static",
                     static_groups=order == "act_order_static")
    qt = gptq_quantize(w, h, cfg, type_name, grid=grid).tensor
    assert qt.grid == type_name and qt.shape == tuple(w.shape)
    ours = qt.dequantize()
    raw = pack(qt)  # llama.cpp's block bytes
    theirs = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])).reshape(w.shape)
    assert torch.equal(theirs, ours)
    gptq_error = _hessian_error(w, ours, h)
    rtn_error = _hessian_error(w, grid.quantize(w).dequantize(), h)
    imatrix_error = _hessian_error(w, grid.quantize(w, torch.diag(h)).dequantize(), h)  # llama.cpp with an imatrix
    assert gptq_error < 0.9 * min(rtn_error, imatrix_error), (gptq_error, rtn_error, imatrix_error)


def test_act_order_needs_static_groups_on_a_gguf_grid() -> None:
    from llmopt.errors import OptionError

    w, h = _problem(cols=256)
    with pytest.raises(OptionError, match="static_groups"):
        gptq_quantize(w, h, GPTQConfig(act_order=True), grid=GRIDS["Q4_K"])


def gptq_into_gguf(tmp_path, mix: str, overrides: list[tuple[str, str]], config: GPTQConfig):
    """A random 2-layer, 256-wide Llama through GPTQ onto the GGUF plan of `mix` with `overrides`,
    written to a file: (the file, the plan, the QuantizedTensors GPTQ produced by module)."""
    from llmopt.formats.gguf.writer import GGUFWriter, grids_for, plan_gguf
    from llmopt.quant.pipeline import QuantizeSpec, quantize_model, quantized_modules
    from tests.formats.gguf.models import make_wide_hf

    hf = make_wide_hf(tmp_path / "hf", "llama", layers=2)
    out = tmp_path / f"gptq-{mix}.gguf"
    produced = {}
    with open_model(hf) as src:
        plan = plan_gguf(src, mix, overrides=overrides)
        spec = QuantizeSpec(config, grids=grids_for(plan), batch_size=2)
        tokens = torch.randint(0, 300, (4, 64), generator=torch.Generator().manual_seed(0))
        with GGUFWriter(src, out, plan, computed=quantized_modules(src, spec)) as writer:
            for block in quantize_model(src, spec, tokens):
                writer.add(block)
                produced.update(block.tensors)
            writer.finish()
    return out, plan, produced


def logits_ours_and_llama_cpp(path) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """A sentence's token ids and the logits of our decoder and of llama.cpp on GGUF file `path`."""
    from llama_cpp import Llama

    from llmopt.model.decoder import Decoder

    with open_model(path) as written:
        ids = written.tokenizer().encode("The quick brown fox jumps over the lazy dog. Pack my box.")
        ours = Decoder.from_source(written)(torch.tensor([ids]))[0].detach()
    llm = Llama(model_path=str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=2)
    llm.eval(ids)
    return ids, ours, torch.tensor(np.asarray(llm.scores[: len(ids)]))


def test_pipeline_into_a_gguf_file_that_llama_cpp_runs(tmp_path) -> None:
    """A random 256-wide Llama through GPTQ onto a Q4_K_M plan with Q4_0/Q8_0 overrides: the file's
    bytes dequantize (gguf's reference code, Q/K rows un-permuted) to exactly what GPTQ produced,
    the types are the plan's, and llama.cpp loads it and gives our decoder's next tokens."""
    from tests.formats.gguf.llama_cpp_helpers import gguf_types

    out, plan, produced = gptq_into_gguf(tmp_path, "Q4_K_M", [("attn_q", "Q4_0"), ("attn_k", "Q8_0")],
                                         GPTQConfig(damp=0.01, group_aware=True))  # fmt: skip
    assert gguf_types(out) == {t.gguf_name: t.type_name for t in plan.tensors}
    assert len(produced) == 14 and {qt.grid for qt in produced.values()} == {"Q4_0", "Q8_0", "Q4_K", "Q6_K"}
    with open_model(out) as written:  # gguf.quants.dequantize, and llama.cpp's Q/K row order undone
        for module, qt in produced.items():
            assert torch.equal(written.load(f"{module}.weight"), qt.dequantize()), module
    ids, ours, theirs = logits_ours_and_llama_cpp(out)
    # llama.cpp multiplies with activations rounded to 8 bits (its own kernels, per CPU): close, not
    # equal, so the top token must agree wherever our margin to the runner-up exceeds twice that error
    # (a random model has near-ties that another CPU's rounding may flip)
    err = (theirs - ours).abs().max()
    assert err < 0.1 * ours.abs().max()
    top2 = ours.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 2 * err
    assert clear.sum() >= len(ids) // 4, (err, top2[:, 0] - top2[:, 1])
    assert torch.equal(theirs.argmax(-1)[clear], ours.argmax(-1)[clear])
