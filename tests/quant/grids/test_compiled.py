"""The numba searches (grids/compiled.py) against the torch ones they replace on CPU: equal bit for bit.

(Both are also checked against llama.cpp's bytes through the grids in test_grids.py; this test pins
the two paths to each other on the awkward cases, so the torch path, which CUDA tensors take, stays
exact too.)"""

from __future__ import annotations

import pytest
import torch

import llmopt.quant.grids.searches as searches
from llmopt.quant.grids.numerics import blocks_major, fp16
from tests.quant.grids.test_grids import edge_weights, importance


def _blocks(n: int) -> torch.Tensor:
    return blocks_major(edge_weights(24, 512), n)


def _both(fn, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
    searches.COMPILED = False
    try:
        ref = fn(*args, **kwargs)
    finally:
        searches.COMPILED = True
    return ref, fn(*args, **kwargs)


def _assert_bits_equal(ref: tuple[torch.Tensor, ...], got: tuple[torch.Tensor, ...]) -> None:
    for a, b in zip(ref, got, strict=True):
        assert a.shape == b.shape
        # levels and scales bit for bit; +0 and -0 alike (C's accumulators start at +0.0f), NaN where the
        # other has NaN (all-denormal blocks: the grids replace those levels)
        torch.testing.assert_close(b.float(), a.float(), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize(("nmax", "search", "mad"), [(15, (-1.0, 0.1, 20), False), (31, (-0.5, 0.1, 15), False),
                                                     (3, (-0.5, 0.1, 15), True), (15, (-0.9, 0.05, 36), False)])  # fmt: skip
@pytest.mark.parametrize("weighted", [False, True])
def test_qkx_search_equals_torch(nmax: int, search: tuple[float, float, int], mad: bool, weighted: bool) -> None:
    x = _blocks(32)
    w = x.abs() + 0.01 if not weighted else blocks_major(importance("random").repeat(24, 1), 32) * x.abs()
    _assert_bits_equal(*_both(searches.make_qkx_quants, x, w, nmax, *search, use_mad=mad))


@pytest.mark.parametrize(("n", "nmax"), [(16, 32), (32, 8), (32, 16), (16, 4)])
@pytest.mark.parametrize("weighted", [False, True])
def test_qx_search_equals_torch(n: int, nmax: int, weighted: bool) -> None:
    x = _blocks(n)
    w = blocks_major(importance("random").repeat(24, 1), n) if weighted else None
    _assert_bits_equal(*_both(searches.make_qx_quants, x, nmax, w))


@pytest.mark.parametrize("n", [16, 32])
def test_row_searches_with_default_weights_equal_torch(n: int) -> None:
    """The kernels' own weights (x², rms(x) + |x|) and the requantization, on blocks by rows."""
    x = _blocks(n).t().contiguous()
    _assert_bits_equal(*_both(searches.qx_rows, x, 32))
    scale, the_min, levels = searches.qkx_rows(x, None, 15, -1.0, 0.1, 20, use_mad=False)
    _assert_bits_equal(*_both(searches.qkx_rows, x, None, 15, -1.0, 0.1, 20, use_mad=False))
    stored = fp16(scale) * (torch.arange(scale.numel()) % 3)  # some scales 0: the levels are kept there
    _assert_bits_equal(*_both(lambda: (searches.requantize_rows(x, levels, stored, the_min, 0, 15),)))


@pytest.mark.parametrize(("n", "nmax", "wrap"), [(8, 63, False), (8, 15, False), (32, 4, True)])
def test_qp_search_equals_torch(n: int, nmax: int, wrap: bool) -> None:
    """make_qp_quants: on sub-block scales (non-negative), and IQ2_XXS's magnitudes with a negated one (wrap)."""
    x = _blocks(n).abs() * 40
    if wrap:
        x[3] = -x[3]  # a flipped sign: negative levels, stored modulo 256
    w = blocks_major(importance("random").repeat(24, 1), n) + 0.5
    _assert_bits_equal(*_both(searches.make_qp_quants, x, nmax, w, wrap=wrap))


@pytest.mark.parametrize("n", [16, 32])
def test_q3_search_equals_torch(n: int) -> None:
    """make_q3_quants (Q3_K without an imatrix): the edge rows, and a scaled copy where moves happen."""
    x = _blocks(n)
    _assert_bits_equal(*_both(searches.make_q3_quants, x, 4))
    _assert_bits_equal(*_both(searches.make_q3_quants, x * 3.7 + 0.01, 4))


@pytest.mark.parametrize("type_name", ["IQ1_S", "IQ1_M", "Q5_0", "Q4_1"])
def test_iq1_and_imatrix_weighted_legacy_chunks_equal_torch(type_name: str) -> None:
    """The IQ1 split scans and neighbour search, and the legacy types' imatrix weights, on more rows of
    ordinary weights than the llama.cpp byte tests hold: every output field equal on both paths."""
    from llmopt.quant.grids import GRIDS

    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 1024, generator=g) * 0.02
    imp = torch.rand(1024, generator=g) ** 3 * 5 + 0.01
    ref, got = _both(GRIDS[type_name].chunk, w, imp)
    assert ref.keys() == got.keys()
    for key in ref:
        torch.testing.assert_close(got[key], ref[key], rtol=0, atol=0)
