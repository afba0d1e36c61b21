"""GPTQ/AWQ layers the int4 kernel does not take, kept as bit planes (runtime/group_int.py): rows are the
source's dequantization bit for bit, a decode step's compiled product equals it to float32 rounding."""

from __future__ import annotations

import pytest
import torch

from llmopt.quantized_tensor import QuantizedTensor
from llmopt.runtime.gguf_linear import stacked
from llmopt.runtime.group_int import GroupIntLinear, kept


def _qt(bits: int, group_size: int, out: int = 40, cols: int = 512, seed: int = 0, **kw) -> QuantizedTensor:
    g = torch.Generator().manual_seed(seed)
    groups = 1 if group_size <= 0 else cols // group_size
    return QuantizedTensor(codes=torch.randint(0, 2**bits, (out, cols), generator=g),
                           scales=(torch.rand(out, groups, generator=g) * 0.01 + 1e-3).half(), bits=bits,
                           group_size=group_size, zeros=torch.randint(0, 2**bits, (out, groups), generator=g), **kw)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("group_size", [32, 128, -1])
def test_rows_are_the_source_dequantization_and_a_step_takes_the_compiled_product(bits, group_size, monkeypatch):
    import llmopt.runtime.gguf_linear as gl
    from llmopt.runtime import gguf_gemv

    qt = _qt(bits, group_size)
    layer = GroupIntLinear(qt, torch.randn(40))
    ref = qt.dequantize()
    assert torch.equal(layer.rows(slice(0, 40)), ref)
    assert torch.equal(layer.rows(torch.tensor([7, 0, 39])), ref[[7, 0, 39]])
    held = sum(b.numel() * b.element_size() for b in layer.buffers())
    assert held <= 48 / 40 * (bits / 8 * 40 * 512 + 3 * 40 * qt.scales.shape[1])  # the bits, + 16-row padding
    x = torch.randn(3, 512)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, ref, layer.bias))  # prefill: the tiles
    calls, real = [], gl.bind_product
    monkeypatch.setattr(gl, "bind_product", lambda *a: calls.append(a[0]) or real(*a))
    monkeypatch.setattr(gl, "tiled_linear", None)  # (a decode step that took the tile path would fail)
    one = torch.randn(1, 1, 512)
    expected = torch.nn.functional.linear(one, ref, layer.bias)
    torch.testing.assert_close(layer(one), expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
    assert len(calls) == 1 and gguf_gemv.compiled_products_work()


def test_odd_widths_uneven_groups_and_no_zero_points_are_left_to_dequantize():
    assert kept(_qt(3, 32)) and kept(_qt(4, 512)) and kept(_qt(8, -1))
    assert kept(_qt(3, 32, g_idx=torch.randperm(512) // 32))  # act-order: columns permuted
    assert not kept(_qt(3, 32, g_idx=torch.randint(0, 16, (512,))))  # groups of other sizes
    assert not kept(_qt(3, 32, cols=528))  # not whole groups of 32
    assert not kept(_qt(3, 48, cols=480))
    sym = _qt(3, 32)
    assert not kept(QuantizedTensor(codes=sym.codes, scales=sym.scales, bits=3, group_size=32))
    assert not kept(_qt(5, 32))


def test_layers_reading_one_input_stack():
    parts = [GroupIntLinear(_qt(3, 64, out=r, seed=r), torch.randn(r)) for r in (32, 16, 16)]
    fused = stacked(parts)
    assert type(fused) is GroupIntLinear and fused.out_features == 64
    assert torch.equal(fused.rows(slice(0, 64)), torch.cat([p.rows(slice(0, p.out_features)) for p in parts]))
    for x in (torch.randn(1, 512), torch.randn(5, 512)):
        torch.testing.assert_close(fused(x), torch.cat([p(x) for p in parts], dim=-1), rtol=1e-5, atol=1e-5)
    assert stacked([parts[0], GroupIntLinear(_qt(4, 64, out=16), None)]) is None  # another bit count


@pytest.mark.parametrize("bits", [3, 4])
def test_act_order_layer_takes_its_input_in_group_order(bits):
    """An act-order layer (g_idx a permutation of whole groups) holds its columns sorted by group and
    permutes its input: the same products as the dequantized weight, in prefill and in a decode step.
    Parts of one order stack; parts of different orders do not."""
    order = torch.randperm(512, generator=torch.Generator().manual_seed(5))
    qt = _qt(bits, 64, g_idx=order // 64)
    layer = GroupIntLinear(qt, None)
    ref = qt.dequantize()
    assert layer.order is not None and torch.equal(layer.rows(slice(0, 40)), ref[:, layer.order])
    x = torch.randn(3, 512)
    assert torch.equal(layer(x), torch.nn.functional.linear(x[:, layer.order], ref[:, layer.order]))
    torch.testing.assert_close(layer(x), x @ ref.t(), rtol=1e-5, atol=1e-5)
    one = torch.randn(1, 512)
    torch.testing.assert_close(layer(one), one @ ref.t(), rtol=1e-5, atol=1e-5 * float((one @ ref.t()).abs().max()))
    same = GroupIntLinear(_qt(bits, 64, out=16, seed=2, g_idx=order // 64), None)
    fused = stacked([layer, same])
    assert fused is not None and torch.equal(fused.order, layer.order)
    torch.testing.assert_close(fused(one), torch.cat([layer(one), same(one)], dim=-1), rtol=1e-5, atol=1e-5)
    other = GroupIntLinear(_qt(bits, 64, out=16, seed=2, g_idx=torch.randperm(512) // 64), None)
    assert stacked([layer, other]) is None and stacked([layer, GroupIntLinear(_qt(bits, 64, out=16), None)]) is None
