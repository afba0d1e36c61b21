"""Decoding with float linears held in float16 (row_major.HalfLinear, runtime.weights.half_weights).

The tolerance of the arithmetic: a few rows round x and y to float16 (relative 2^-11 each, of the row's
largest magnitude), sums stay float32; more rows widen W and are float32 throughout."""

import pytest
import torch

from llmopt.model.kv_cache import StaticKVCache
from llmopt.runtime.generate import Generator
from llmopt.runtime.row_major import HALF_PRODUCT_ROWS, HalfLinear, TiedEmbedding
from llmopt.runtime.weights import load_model

FLOAT16_STEP = 2.0**-11  # float16's relative rounding step


def halved(out: int, inp: int, seed: int = 0) -> torch.Tensor:
    """A float32 weight whose values float16 holds exactly (as an F16 file's)."""
    return torch.randn(out, inp, generator=torch.Generator().manual_seed(seed)).half().float()


def test_few_rows_are_within_float16_rounding_of_the_exact_product():
    w = halved(300, 200)
    layer = HalfLinear(w, torch.linspace(-1, 1, 300))
    for rows in (1, HALF_PRODUCT_ROWS):
        x = torch.randn(rows, 200, generator=torch.Generator().manual_seed(rows))
        exact = x.double() @ w.double().t() + torch.linspace(-1, 1, 300).double()
        # x's rounding moves each output by at most 2^-11 |x| . |w| summed; y's by 2^-11 |y|
        bound = FLOAT16_STEP * ((x.abs().double() @ w.abs().double().t()) + exact.abs()) + 1e-5
        assert ((layer(x).double() - exact).abs() <= bound).all()
        assert not torch.equal(layer(x), torch.nn.functional.linear(x, w, layer.bias))  # float16 was used


def test_many_rows_widen_the_weight_and_are_float32():
    w = halved(300, 200)
    layer = HalfLinear(w, None)
    x = torch.randn(2, HALF_PRODUCT_ROWS, 200, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(layer(x), torch.nn.functional.linear(x, w), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("magnitude", [1e9, 1e-12])
def test_activations_beyond_float16_range_neither_overflow_nor_vanish(magnitude: float):
    """float16 holds 6.1e-5 .. 65504; the rows are scaled into it and back."""
    w = halved(64, 128)
    x = torch.randn(1, 128, generator=torch.Generator().manual_seed(2)) * magnitude
    exact = (x.double() @ w.double().t())
    y = HalfLinear(w, None)(x).double()
    assert torch.isfinite(y).all()
    assert ((y - exact).abs() <= 2 * FLOAT16_STEP * (x.abs().double() @ w.abs().double().t())).all()


def decode_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits of every position fed one token at a time through the cache (the decode steps' shape)."""
    cache = StaticKVCache(model.arch, len(ids))
    with torch.no_grad():
        return torch.cat([model(torch.tensor([[t]]), i, cache)[0] for i, t in enumerate(ids)])


@pytest.mark.parametrize("tie", [False, True])
def test_a_decoding_load_of_an_f16_file_holds_float16_and_stays_within_its_rounding(tiny_ggufs, tie: bool):
    path = str(tiny_ggufs("llama", "F16", tie))
    half = load_model(path, "auto", "cpu", decode=True).model
    exact = load_model(path, "auto", "cpu").model
    assert isinstance(half.layers[0].self_attn.qkv, HalfLinear) and isinstance(half.layers[0].mlp.gate_up, HalfLinear)
    assert isinstance(half.lm_head, HalfLinear) and isinstance(half.embed_tokens, TiedEmbedding) == tie
    assert not any(isinstance(m, HalfLinear) for m in exact.modules())
    ids = torch.randint(0, 300, (17,), generator=torch.Generator().manual_seed(5)).tolist()
    ours, theirs = decode_logits(half, ids), decode_logits(exact, ids)
    assert (ours - theirs).abs().max() <= 1e-2 * theirs.abs().max()  # float16 rounding through 2 layers
    assert not torch.equal(ours, theirs)
    with torch.no_grad():  # a prompt's rows: float32 throughout, the same function
        assert torch.allclose(half(torch.tensor([ids])), exact(torch.tensor([ids])), rtol=1e-5, atol=1e-5)


def test_float32_weights_an_explicit_float32_and_scoring_keep_float32(tiny_ggufs):
    """A float32 file's weights stay exact; `--dtype float32` forces float32; `eval` (not decoding) too."""
    for path, dtype, decode in ((tiny_ggufs("llama", "F32"), "auto", True), (tiny_ggufs("llama", "F16"), "float32", True),
                                (tiny_ggufs("llama", "Q8_0"), "auto", False)):
        model = load_model(str(path), dtype, "cpu", quantized=False, decode=decode).model
        assert not any(isinstance(m, HalfLinear) for m in model.modules()), (path, dtype, decode)
    dequantized = load_model(str(tiny_ggufs("llama", "Q8_0")), "auto", "cpu", quantized=False, decode=True).model
    assert isinstance(dequantized.lm_head, HalfLinear)


@pytest.mark.slow
def test_smollm2_decodes_the_same_greedy_text_with_float16_weights(smollm2_gguf):
    """The real model: 32 greedy tokens per prompt from float16-held weights equal the float32 model's,
    and every decode step's logits stay within float16's rounding of them."""
    half = load_model(str(smollm2_gguf), "auto", "cpu", decode=True)
    exact = load_model(str(smollm2_gguf), "auto", "cpu")
    assert isinstance(half.model.lm_head, HalfLinear)
    tok = half.tokenizer
    for prompt in ("The capital of France is", "def fibonacci(n):"):
        ids = tok.encode(prompt)
        ours = Generator(half.model, tok).generate(ids, 32, ignore_eos=True).token_ids
        assert ours == Generator(exact.model, tok).generate(ids, 32, ignore_eos=True).token_ids, prompt
        a, b = decode_logits(half.model, ids + ours), decode_logits(exact.model, ids + ours)
        assert (a - b).abs().max() <= 5e-3 * b.abs().max()  # (measured 1.8e-3 on this text)


@pytest.mark.parametrize("tie", [False, True])
def test_the_assembly_reads_linear_weights_straight_into_float16(tiny_ggufs, tie: bool):
    """Before the layout step, every linear's weight (a tied head's table too) is already float16, the rest
    float32: the load never holds the linears in float32 (its peak is the float16 model plus one tensor)."""
    from torch import nn

    from llmopt.model import open_model
    from llmopt.runtime.weights import assemble

    with open_model(str(tiny_ggufs("llama", "Q8_0", tie))) as src:
        model = assemble(src, torch.float32, torch.device("cpu"), keep=False, half_linears=True)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(m.weight.dtype == torch.float16 for m in linears)
    assert (model.embed_tokens.weight.dtype == torch.float16) == tie
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if "norm" in n)
