"""SmolLM2 GGUF files written by llmopt, run with their weights quantized in memory: greedy decoding
gives the dequantized model's tokens (float32 compute; decode steps through the compiled products of
runtime/gguf_gemv.py), and memory holds about the file. Between them the mixes hold every type with a
compiled product but Q2_K (SmolLM2's 576-wide rows fall back from it; the random models of
test_gguf_linear.py carry it): Q4_0, Q5_1, Q5_K, Q4_K, Q5_0, Q3_K, Q6_K, Q8_0, F16; the last test puts every
other type llmopt writes on some layers (gguf_lattice.py, gguf_codes.py, IQ4)."""

from __future__ import annotations

import pytest
import torch

from llmopt.api.generate import generate
from llmopt.formats.gguf.writer import plan_gguf, write_gguf
from llmopt.model import open_model
from llmopt.runtime.gguf_gemv import compiled_products_work
from llmopt.runtime.gguf_linear import F16Linear, Int8GroupLinear, KLowLinear, NibbleLinear, Q6KLinear
from llmopt.runtime.weights import load_model

PROMPT = "The history of the Roman Empire"


@pytest.fixture(scope="module")
def smollm2_files(smollm2_gguf, tmp_path_factory):
    root = tmp_path_factory.mktemp("smollm2-mixes")

    def write(mix: str):
        out = root / f"smollm2-{mix}.gguf"
        if not out.exists():
            with open_model(smollm2_gguf) as src:
                write_gguf(src, out, plan_gguf(src, mix, has_imatrix=False))
        return out

    return write


def _held_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


@pytest.mark.slow
@pytest.mark.parametrize(("mix", "cls"), [("Q4_0", NibbleLinear), ("Q8_0", Int8GroupLinear), ("Q4_K_M", Q6KLinear),
                                          ("Q5_K_M", NibbleLinear), ("Q2_K", KLowLinear), ("F16", F16Linear)])
def test_greedy_64_tokens_equal_the_dequantized_model(smollm2_files, mix, cls):
    path = smollm2_files(mix)
    kept = load_model(str(path), "float32", "cpu", quantized=True)
    dense = load_model(str(path), "float32", "cpu", quantized=False)
    assert any(isinstance(m, cls) for m in kept.model.modules())
    assert _held_bytes(kept.model) < (0.51 if mix == "F16" else 0.5) * _held_bytes(dense.model)  # F16: 2 bytes, not 4
    a = generate(kept, PROMPT, max_tokens=64, ignore_eos=True).token_ids
    b = generate(dense, PROMPT, max_tokens=64, ignore_eos=True).token_ids
    assert len(a) == 64 and a == b
    assert compiled_products_work()  # the decode steps took the compiled products, not the tile path


# the types llmopt writes beyond the mixes above, one a layer on ffn_down (the 1536-wide rows that 256-value
# blocks fit; SmolLM2's 576-wide ones do not), and the 32/64-value ones on three layers' 576-wide rows each,
# on layers whose loss the model bears (on layers 0-10 it repeats a token); the rest stays Q8_0
LOW_BIT_DOWN = ("IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0", "Q1_0", "IQ4_XS")
LOW_BIT = [(rf"blk\.{i}\.ffn_down", t) for i, t in enumerate(LOW_BIT_DOWN, start=16)]
LOW_BIT += [(r"blk\.[5-7]\.ffn_up", "MXFP4"), (r"blk\.(8|9|10)\.ffn_gate", "NVFP4"),
            (r"blk\.1[1-3]\.attn_output", "Q2_0"), (r"blk\.[2-4]\.attn_q", "IQ4_NL")]


@pytest.mark.slow
def test_every_lattice_and_code_type_decodes_the_dequantized_tokens(smollm2_gguf, tmp_path):
    """IQ3/IQ2/IQ1, ternary, Q1_0/Q2_0, FP4 and IQ4 weights kept quantized (gguf_lattice.py, gguf_codes.py,
    IQ4Linear): 64 greedy tokens equal the dequantized model's. The file is written with a flat importance matrix, which
    the i-quants below IQ3_S need (speed and exactness only: the text is not meant to be good)."""
    from llmopt.runtime.gguf_codes import CodeLinear
    from llmopt.runtime.gguf_lattice import LatticeLinear
    from llmopt.runtime.gguf_linear import IQ4Linear

    out = tmp_path / "smollm2-low-bit.gguf"
    with open_model(smollm2_gguf) as src:
        plan = plan_gguf(src, "Q8_0", has_imatrix=True, overrides=LOW_BIT)
        flat = {t.gguf_name: torch.ones(t.shape[-1]) for t in plan.tensors if len(t.shape) == 2}
        write_gguf(src, out, plan, importance=flat)
    kept = load_model(str(out), "float32", "cpu", quantized=True)
    dense = load_model(str(out), "float32", "cpu", quantized=False)
    held = {m.kind for m in kept.model.modules() if isinstance(m, (LatticeLinear, CodeLinear))}
    assert held == {*LOW_BIT_DOWN, "MXFP4", "NVFP4", "Q2_0"} - {"IQ4_XS"}
    iq4 = {m.per for m in kept.model.modules() if isinstance(m, IQ4Linear)}
    assert iq4 == {1, 8}  # IQ4_NL: a d per group of 32; IQ4_XS: per 8 groups
    a = generate(kept, PROMPT, max_tokens=64, ignore_eos=True).token_ids
    b = generate(dense, PROMPT, max_tokens=64, ignore_eos=True).token_ids
    assert len(a) == 64 and a == b and len(set(a)) > 20  # (varied text: 42 distinct tokens when written)
    assert compiled_products_work()
