"""GGUF weights kept quantized in memory (CPU): each module rebuilds the weights gguf's reference
dequantizer reads, and whole models give the dequantized model's logits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from llmopt.formats.gguf.blocks import pack
from llmopt.formats.gguf.writer import plan_gguf, write_gguf
from llmopt.model import open_model
from llmopt.model.ggml_types import PARTS, GGMLQuantType
from llmopt.quant.grids import quantize
from llmopt.runtime.gguf_codes import CodeLinear
from llmopt.runtime.gguf_lattice import LatticeLinear
from llmopt.runtime.gguf_linear import (F16Linear, Int8GroupLinear, IQ4Linear, KLowLinear, NibbleLinear, Q6KLinear,
                                        QuantizedEmbedding, RawGGUFLinear, int4_parts, stacked)
from llmopt.runtime.int4 import PackedInt4Linear
from llmopt.runtime.linear import QuantizedLinear, RowSource, quantized_module
from llmopt.runtime.weights import _float, load_model
from tests.formats.gguf.models import make_wide_hf

Q = GGMLQuantizationType
QUANTIZED = (Int8GroupLinear, NibbleLinear, Q6KLinear, KLowLinear, F16Linear, IQ4Linear, LatticeLinear, CodeLinear,
             RawGGUFLinear, PackedInt4Linear)
LATTICE = [Q.IQ3_XXS, Q.IQ3_S, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ1_S, Q.IQ1_M]
CODES = [Q.TQ1_0, Q.TQ2_0, Q.MXFP4, Q.NVFP4]  # (and Q1_0/Q2_0, which gguf cannot read: below)


def _blocks(qtype: GGMLQuantizationType, rows: int = 32, cols: int = 512, seed: int = 0) -> torch.Tensor:
    """llmopt's own quantizer and block packer (the GGUF writer's), rows of block bytes."""
    w = torch.from_numpy(np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.02)
    if qtype == Q.F16:
        return w.half().view(torch.uint8)
    importance = torch.rand(cols, generator=torch.Generator().manual_seed(seed)) + 0.5  # (IQ2_XXS/XS, IQ1_S need one)
    blocks = pack(quantize(qtype.name, w, importance if qtype in LATTICE else None))
    return torch.from_numpy(np.ascontiguousarray(blocks)).view(torch.uint8).reshape(rows, -1)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K])
def test_int4_parts_are_the_reference_dequantization(qtype):
    data = _blocks(qtype)
    codes, scales, offsets = int4_parts(qtype, data)
    assert int(codes.min()) >= 0 and int(codes.max()) <= 15
    w = ((codes.float() - 8).reshape(32, -1, 32) * scales[..., None] + offsets[..., None]).reshape(32, -1)
    ref = torch.from_numpy(dequantize(data.numpy(), qtype))
    torch.testing.assert_close(w, ref, rtol=1e-6, atol=1e-7)  # same values, summed in another order


@pytest.mark.parametrize(("qtype", "cls"), [(Q.Q8_0, Int8GroupLinear), (Q.Q4_0, NibbleLinear), (Q.Q4_1, NibbleLinear),
                                           (Q.Q4_K, NibbleLinear), (Q.Q5_0, NibbleLinear),
                                           (Q.Q5_1, NibbleLinear), (Q.Q5_K, NibbleLinear), (Q.Q6_K, Q6KLinear),
                                           (Q.Q2_K, KLowLinear), (Q.Q3_K, KLowLinear), (Q.F16, F16Linear),
                                           (Q.IQ4_NL, IQ4Linear), (Q.IQ4_XS, IQ4Linear),
                                           *((q, LatticeLinear) for q in LATTICE), *((q, CodeLinear) for q in CODES)])
def test_float32_linears_equal_the_dequantized_linear_exactly(qtype, cls, monkeypatch):
    import llmopt.runtime.gguf_linear as gl

    monkeypatch.setattr(gl, "TILE_BYTES", 16 * 512 * 4)  # several tiles of 16 rows
    data = _blocks(qtype, rows=48, cols=512)
    layer = quantized_module(qtype, data, None)
    assert isinstance(layer, cls)
    x = torch.randn(3, 512)
    ref = torch.from_numpy(dequantize(data.numpy(), qtype))
    if hasattr(layer, "rows"):
        assert torch.equal(layer.rows(slice(0, 48)), ref)
    own = {n: b for n, b in layer.named_buffers() if n != "lookup"}  # (a type's table: one tensor for every layer)
    held = sum(b.untyped_storage().nbytes() for b in {b.untyped_storage().data_ptr(): b for b in own.values()}.values())
    assert held <= 1.04 * data.numel(), (held, data.numel())  # about the file's (Q4_K 148 for 144, IQ1_M 58 for 56)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, ref))
    ids = torch.tensor([[5, 0, 47], [5, 5, 1]])  # the same rows serve a tied embedding
    assert torch.equal(QuantizedEmbedding(layer, torch.float32)(ids), ref[ids])


def test_a_type_without_a_module_of_its_own_takes_the_reference_dequantizer_per_tile(monkeypatch):
    """RawGGUFLinear, for a type no field module reads (a file from another writer): gguf's numpy tiles."""
    import llmopt.runtime.gguf_linear as gl

    monkeypatch.setattr(gl, "TILE_BYTES", 16 * 512 * 4)
    data = _blocks(Q.TQ2_0, rows=48, cols=512)
    layer = RawGGUFLinear(Q.TQ2_0, data, None)
    ref = torch.from_numpy(dequantize(data.numpy(), Q.TQ2_0))
    x = torch.randn(1, 512)
    assert torch.equal(layer.rows(slice(0, 48)), ref) and torch.equal(layer(x), torch.nn.functional.linear(x, ref))


@pytest.mark.parametrize("name", ["Q1_0", "Q2_0"])
def test_q1_0_and_q2_0_modules_read_as_llmopts_own_dequantizer(name):
    """Q1_0 and Q2_0 (gguf has no values for them): CodeLinear's rows are model/dequantize.py's, its decode
    product their product."""
    from llmopt.model.dequantize import dequantize as ours
    from llmopt.model.ggml_types import GGMLQuantType

    w = torch.from_numpy(np.random.default_rng(1).standard_normal((40, 512)).astype(np.float32) * 0.02)
    data = torch.from_numpy(np.ascontiguousarray(pack(quantize(name, w)))).view(torch.uint8).reshape(40, -1)
    layer = quantized_module(GGMLQuantType[name], data, None)
    ref = torch.from_numpy(ours(data.numpy(), GGMLQuantType[name]))
    assert isinstance(layer, CodeLinear) and torch.equal(layer.rows(slice(0, 40)), ref)
    x = torch.randn(1, 512)
    torch.testing.assert_close(layer(x), x @ ref.t(), rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def test_int4_kernel_rounds_only_scales_and_activations_to_bfloat16():
    """The kernel's product equals the product of bfloat16-rounded inputs and scale/offset pairs."""
    data = _blocks(Q.Q4_K)
    layer = quantized_module(Q.Q4_K, data, None, torch.bfloat16)
    assert isinstance(layer, PackedInt4Linear)
    codes, scales, offsets = int4_parts(Q.Q4_K, data)
    bf = lambda t: t.to(torch.bfloat16).float()  # noqa: E731
    w = ((codes.float() - 8).reshape(32, -1, 32) * bf(scales)[..., None] + bf(offsets)[..., None]).reshape(32, -1)
    x = torch.randn(3, 512)
    torch.testing.assert_close(layer(x), bf(x) @ w.t(), rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("qtype", [Q.Q6_K, Q.Q4_0, Q.IQ4_XS, Q.TQ2_0])
def test_an_untied_embedding_keeps_its_table_quantized_and_dequantizes_the_rows_it_reads(qtype):
    data = _blocks(qtype, rows=10, cols=256)
    table = quantized_module(qtype, data, None, rows=True)
    assert not isinstance(table, (RawGGUFLinear, PackedInt4Linear))  # torch ops on the table's device
    emb = QuantizedEmbedding(table, torch.bfloat16)
    ids = torch.tensor([[3, 0, 9], [3, 3, 1]])
    ref = torch.from_numpy(dequantize(data.numpy(), qtype))
    assert torch.equal(emb(ids), ref[ids].to(torch.bfloat16))


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """family -> an HF dir whose rows divide into 256 (every K-quant applies); qwen2 tied, with biases."""
    cache = {}

    def get(family: str) -> Path:
        if family not in cache:
            root = tmp_path_factory.mktemp(f"wide-{family}")
            cache[family] = make_wide_hf(root / "hf", family, layers=2, tie=family == "qwen2")
        return cache[family]

    return get


def _write(hf: Path, out: Path, mix: str, overrides=()) -> Path:
    """The file of `mix` (with per-tensor `overrides`); a flat importance matrix where an override needs one."""
    with open_model(hf) as src:
        lattice = any(t in {q.name for q in LATTICE} for _, t in overrides)
        plan = plan_gguf(src, mix, has_imatrix=lattice, overrides=list(overrides))
        flat = {t.gguf_name: torch.ones(t.shape[-1]) for t in plan.tensors if len(t.shape) == 2} if lattice else None
        return write_gguf(src, out, plan, importance=flat)


# every type llmopt writes, by mix or by a per-tensor override
CASES = [("llama", m, ()) for m in ("F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K_M", "Q4_K_M",
                                    "Q5_K_M", "Q6_K", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0")]
CASES += [("llama", "Q8_0", [("ffn_down", "MXFP4"), ("ffn_up", "NVFP4")]), ("qwen2", "Q8_0", ()), ("qwen2", "Q4_K_M", ())]
CASES += [("llama", "Q8_0", [("ffn_down", "IQ3_XXS"), ("ffn_up", "IQ3_S"), ("ffn_gate", "IQ2_S"),
                             ("attn_output", "IQ1_M")]),
          ("llama", "Q8_0", [("ffn_down", "IQ2_XXS"), ("ffn_up", "IQ2_XS"), ("ffn_gate", "IQ1_S")]),
          ("llama", "Q8_0", [("ffn_down", "Q1_0"), ("ffn_up", "Q2_0")])]
IDS = [f"{f}-{m}{'+' + o[0][1] if o else ''}" for f, m, o in CASES]


@pytest.mark.parametrize(("family", "mix", "overrides"), CASES, ids=IDS)
def test_quantized_in_memory_model_gives_the_dequantized_logits(wide, tmp_path, family, mix, overrides):
    path = _write(wide(family), tmp_path / "m.gguf", mix, overrides)
    kept = load_model(str(path), "float32", "cpu", quantized=True).model
    dense = load_model(str(path), "float32", "cpu", quantized=False).model
    table = kept.embed_tokens.table  # the embedding's quantized rows: the tied head's, else its own module
    layers = [m for m in kept.modules() if isinstance(m, QUANTIZED) and (m is not table or m is kept.lm_head)]
    a = kept.arch  # every block linear and the LM head stay quantized (q/k/v, gate/up fused where types match)
    block_rows = (a.num_heads + 2 * a.num_kv_heads) * a.head_dim + 2 * a.hidden_size + 2 * a.intermediate_size
    assert sum(m.out_features for m in layers) == a.num_layers * block_rows + a.vocab_size
    assert not any(isinstance(m, torch.nn.Linear) for m in kept.modules())
    tied = family == "qwen2" and not isinstance(kept.lm_head, PackedInt4Linear)
    assert isinstance(kept.embed_tokens, QuantizedEmbedding) and (kept.embed_tokens.table is kept.lm_head) == tied
    assert not any(isinstance(m, QUANTIZED) for m in dense.modules())
    ids = torch.randint(0, 300, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = kept(ids), dense(ids)
    assert (a - b).abs().max() <= 1e-3 * b.abs().max()


@pytest.mark.parametrize(("family", "mix", "overrides"), CASES, ids=IDS)
def test_a_dequantized_model_loads_the_reference_dequantizers_weights(wide, tmp_path, family, mix, overrides):
    """The load of a dequantized model rebuilds each weight by its module's rows (torch), for speed: bit for
    bit what the reader (gguf's reference dequantizer, llmopt's for Q1_0/Q2_0) gives."""
    path = _write(wide(family), tmp_path / "m.gguf", mix, overrides)
    with open_model(path) as src:
        for name in src.tensors:
            assert torch.equal(_float(src, name, torch.float32, torch.device("cpu")), src.load(name)), name


@pytest.mark.parametrize("mix", ["Q4_0", "Q4_K_M"])
def test_bfloat16_model_takes_the_int4_kernel_within_its_rounding(wide, tmp_path, mix):
    """bfloat16 activations and scale/offset pairs: ~3 significant digits per product, so logits agree
    to about 2% of their range and the top token almost everywhere (as GPTQ's packed path)."""
    path = _write(wide("llama"), tmp_path / "m.gguf", mix)
    kept = load_model(str(path), "bfloat16", "cpu", quantized=True).model
    dense = load_model(str(path), "float32", "cpu", quantized=False).model
    assert sum(isinstance(m, PackedInt4Linear) for m in kept.modules()) >= 8
    ids = torch.randint(0, 300, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = kept(ids).float(), dense(ids)
    assert (a - b).abs().max() < 0.03 * b.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9


def test_a_kernel_shape_it_cannot_tile_falls_back_to_the_blocks():
    data = _blocks(Q.Q4_0, rows=40)  # the kernel packs 16 output rows at a time
    layer = quantized_module(Q.Q4_0, data, None, torch.bfloat16)
    assert isinstance(layer, NibbleLinear)
    x = torch.randn(2, 512)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, torch.from_numpy(dequantize(data.numpy(), Q.Q4_0))))


def test_a_table_read_by_rows_never_takes_the_int4_kernel():
    """The registry's `rows`: a bfloat16 Q4_0 head takes the int4 kernel, whose packing gives no rows back;
    the same bytes as a table (an untied embedding) take the type's field module. Both keep the contract."""
    data = _blocks(Q.Q4_0, rows=32)
    head = quantized_module(Q.Q4_0, data, None, torch.bfloat16)
    table = quantized_module(Q.Q4_0, data, None, torch.bfloat16, rows=True)
    assert isinstance(head, PackedInt4Linear) and not isinstance(head, RowSource)
    assert isinstance(table, NibbleLinear) and isinstance(table, RowSource)
    assert all(isinstance(m, QuantizedLinear) and (m.out_features, m.in_features) == (32, 512) for m in (head, table))


def test_by_default_a_gguf_stays_quantized_only_when_dequantized_it_would_not_fit(wide, tmp_path, monkeypatch):
    """Dequantized decode is faster, so it is the default while the float model takes at most half the
    available memory; beyond that the weights stay quantized (a 7B Q4 file on a small machine)."""
    import llmopt.runtime.weights as weights

    path = _write(wide("llama"), tmp_path / "m.gguf", "Q4_0", ())
    monkeypatch.setattr(weights, "available_memory", lambda: 1 << 40)
    roomy = load_model(str(path), "float32", "cpu").model
    assert not any(isinstance(m, QUANTIZED) for m in roomy.modules())
    monkeypatch.setattr(weights, "available_memory", lambda: 1 << 20)
    tight = load_model(str(path), "float32", "cpu").model
    assert sum(isinstance(m, QUANTIZED) for m in tight.modules()) == 2 * 4 + 2  # q/k/v, gate/up fused; head, embedding
    assert not any(isinstance(m, QUANTIZED) for m in load_model(str(path), "float32", "cpu", quantized=False).model.modules())


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.Q6_K, Q.Q2_K, Q.Q3_K,
                                   Q.F16, Q.IQ4_NL, Q.IQ4_XS, *LATTICE, *CODES])
def test_a_decode_step_takes_the_compiled_product(qtype, monkeypatch):
    """One input row: the compiled product over the stored fields (gguf_gemv.py), equal to the
    dequantized product up to float32 summation order; with a bias, and with a leading batch shape."""
    import llmopt.runtime.gguf_linear as gl
    from llmopt.runtime import gguf_gemv

    data = _blocks(qtype, rows=40, cols=512, seed=3)
    bias = torch.randn(40)
    layer = quantized_module(qtype, data, bias)
    ref = torch.from_numpy(dequantize(data.numpy(), qtype))
    x = torch.randn(1, 1, 512)
    calls, real = [], gl.bind_product
    monkeypatch.setattr(gl, "bind_product", lambda *a: calls.append(a[0]) or real(*a))
    monkeypatch.setattr(gl, "tiled_linear", None)  # (a decode step that took the tile path would fail)
    y = layer(x)
    assert len(calls) == 1 and gguf_gemv.compiled_products_work()
    expected = torch.nn.functional.linear(x, ref, bias)
    assert y.shape == (1, 1, 40)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
    half = layer(x.bfloat16())  # a bfloat16 model's step: the product in float32, the result rounded
    assert half.dtype == torch.bfloat16 and len(calls) == 1  # bound to the fields once
    torch.testing.assert_close(half.float(), torch.nn.functional.linear(x.bfloat16().float(), ref, bias),
                               rtol=1e-2, atol=1e-2 * float(expected.abs().max()))  # fmt: skip


def test_iq4_levels_by_arithmetic_are_the_table():
    """The compiled IQ4 product computes llama.cpp's 16 levels with a rounded polynomial (no lookup), also
    from high nibbles masked in place (codes 16 times the index)."""
    from llmopt.quant.grids.codebooks import IQ4_VALUES
    from llmopt.runtime.gguf_gemv import iq4_levels

    codes = torch.arange(16, dtype=torch.uint8)
    levels = torch.tensor(IQ4_VALUES, dtype=torch.float32)
    assert torch.equal(iq4_levels(codes), levels)
    assert torch.equal(iq4_levels(codes * 16 + 5 & 240, 16), levels)


def test_a_decode_step_binds_again_when_the_fields_are_replaced():
    """The product bound to a module's fields follows them when they are replaced (`.to()`, the arena):
    zeroed copies give a zero product, not the old fields' one."""
    layer = quantized_module(Q.Q8_0, _blocks(Q.Q8_0, rows=32, cols=256), None)
    x = torch.randn(1, 256)
    assert layer(x).abs().max() > 0
    layer._apply(torch.zeros_like)
    assert torch.equal(layer(x), torch.zeros(1, 32))


def test_without_a_compiler_the_decode_step_takes_the_tile_path(monkeypatch, caplog):
    """A compile failure is logged once and every later product is the exact tile path."""
    import torch._inductor

    from llmopt.runtime import gguf_gemv

    def broken(graph, inputs):
        raise RuntimeError("no C++ compiler found\nmore")

    monkeypatch.setattr(gguf_gemv, "_compiled", {})
    monkeypatch.setattr(gguf_gemv, "_failed", False)
    monkeypatch.setattr(torch._inductor, "compile", broken)
    data = _blocks(Q.Q4_0, rows=20, cols=256)
    layer = quantized_module(Q.Q4_0, data, None)
    ref = torch.from_numpy(dequantize(data.numpy(), Q.Q4_0))
    x = torch.randn(1, 256)
    with caplog.at_level("WARNING"):
        assert torch.equal(layer(x), torch.nn.functional.linear(x, ref))
        assert torch.equal(layer(x), torch.nn.functional.linear(x, ref))
    assert not gguf_gemv.compiled_products_work()
    assert sum("no C++ compiler found" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q5_1, Q.Q5_K, Q.Q6_K, Q.Q2_K, Q.Q3_K, Q.F16, Q.IQ4_NL,
                                   Q.IQ4_XS, Q.IQ3_XXS, Q.IQ2_XS, Q.IQ1_M, Q.TQ1_0, Q.NVFP4])
def test_linears_reading_one_input_stack_into_one_module(qtype):
    """q/k/v (or gate/up) of one layout become one module: its rows and products are the parts', stacked;
    parts of different layouts stay apart."""
    parts = [quantized_module(qtype, _blocks(qtype, rows=r, seed=r), torch.randn(r)) for r in (32, 16, 16)]
    fused = stacked(parts)
    assert type(fused) is type(parts[0]) and fused.out_features == 64 and fused.in_features == 512
    held = {b.untyped_storage().data_ptr(): b.untyped_storage().nbytes() for p in [fused] for b in p.buffers()}
    assert sum(held.values()) == sum({b.untyped_storage().data_ptr(): b.untyped_storage().nbytes()
                                      for p in parts for b in p.buffers()}.values())  # nothing held twice
    assert torch.equal(fused.rows(slice(0, 64)), torch.cat([p.rows(slice(0, p.out_features)) for p in parts]))
    for x in (torch.randn(1, 512), torch.randn(5, 512)):  # a decode step's compiled product, and tiles
        torch.testing.assert_close(fused(x), torch.cat([p(x) for p in parts], dim=-1), rtol=1e-5, atol=1e-5)
    other = Q.Q4_1 if qtype == Q.Q4_0 else Q.Q4_0  # another layout (Q4_0 against Q4_1: another multiplier)
    assert stacked([parts[0], quantized_module(other, _blocks(other), torch.randn(32))]) is None
    assert stacked([parts[0], quantized_module(qtype, _blocks(qtype), None)]) is None  # with and without a bias


@pytest.mark.parametrize(("mix", "overrides", "held"), [
    ("Q4_K_M", [("attn_v", "Q8_0"), ("attn_q", "Q5_0")], {NibbleLinear, Int8GroupLinear, Q6KLinear}),
    ("Q8_0", [("ffn_down", "IQ2_XS"), ("ffn_up", "MXFP4"), ("attn_output", "TQ1_0")], {LatticeLinear, CodeLinear}),
], ids=["k-and-legacy", "lattice-and-codes"])
def test_compiled_decode_step_of_a_model_kept_quantized_gives_eager_tokens(wide, tmp_path, mix, overrides, held):
    """`generate --compile` on a GGUF kept quantized: the products are traced into the step's graph
    (not called as separately compiled functions) and the quantized embedding is looked up outside it."""
    from llmopt.runtime.generate import Generator

    path = _write(wide("llama"), tmp_path / "m.gguf", mix, overrides)
    kept = load_model(str(path), "float32", "cpu", quantized=True).model
    assert isinstance(kept.embed_tokens, QuantizedEmbedding)
    assert {type(m) for m in kept.modules()} >= held
    prompt = [5, 17, 230, 9]
    eager = Generator(kept, None, eos=set()).generate(prompt, 8).token_ids
    assert Generator(kept, None, eos=set(), compile=True).generate(prompt, 8).token_ids == eager


@pytest.mark.parametrize("name", list(PARTS))
def test_every_type_llmopt_writes_has_a_module_of_its_own(name):
    """The runtime half of a type's parts: every type named in ggml_types.PARTS (what llmopt writes)
    has a registry entry that keeps it quantized in a float32 model, never the generic tile fallback."""
    qtype = GGMLQuantType[name]
    layer = quantized_module(qtype, _blocks(qtype, rows=16, cols=256), None)
    assert layer is not None and not isinstance(layer, RawGGUFLinear), type(layer).__name__
