"""RTN on the integer grid, and the error metrics reported for every layer."""

from __future__ import annotations

import math

import pytest
import torch

from llmopt.quant.grids.integer import IntGrid
from llmopt.quant.metrics import weight_error
from llmopt.quant.rtn import RTNConfig, rtn_quantize


def _w(rows=16, cols=256, seed=0) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("group_size", [0, -1, 32, 128])
def test_rtn_rounds_to_nearest_grid_point(bits: int, sym: bool, group_size: int) -> None:
    w = _w()
    qt = rtn_quantize(w, RTNConfig(bits, group_size, sym))
    n_groups = {0: 1, -1: 1}.get(group_size, 256 // max(group_size, 1))
    assert qt.scales.shape == ((1, 1) if group_size == 0 else (16, n_groups))
    assert int(qt.codes.max()) <= (1 << bits) - 1
    deq = qt.dequantize()
    scale = qt._per_column(qt.scales)
    err = (w - deq).abs()
    # every weight inside the grid's range is within half a step; the sym grid's top code may clip by < 1 step
    assert bool((err <= scale * (1.0 if sym else 0.5) + 1e-6).all())
    # nearest: no other code of the same group is closer
    zeros = qt._per_column(qt.zeros.float()) if qt.zeros is not None else 2 ** (bits - 1)
    for delta in (-1, 1):
        other = ((qt.codes.float() + delta).clamp(0, (1 << bits) - 1) - zeros) * scale
        assert bool(((w - other).abs() >= err - 1e-6).all())


def test_more_bits_less_error() -> None:
    w = _w(64, 512)
    sqnr = [weight_error(w, rtn_quantize(w, RTNConfig(b, 128, False)).dequantize())["sqnr_db"] for b in range(2, 9)]
    assert all(b > a + 4 for a, b in zip(sqnr, sqnr[1:]))  # ~6 dB per bit
    assert 6.02 * 8 - 12 < sqnr[-1] < 6.02 * 8 + 3


def test_asym_zero_min_keeps_range() -> None:
    w = _w().abs() + 0.1  # all positive: zero would be 0
    grid = IntGrid(4, sym=False, zero_min=1)
    scale, zero = grid.params(w)
    assert bool((zero >= 1).all())
    assert bool(((grid.fake_quantize(w, scale, zero) - w).abs() <= scale.unsqueeze(1) / 2 + 1e-6).all())


def test_mse_clipping_lowers_error() -> None:
    w = torch.distributions.StudentT(3.0).sample((64, 128))  # heavy tails: clipping pays
    plain = weight_error(w, rtn_quantize(w, RTNConfig(3, 128, True)).dequantize())["mse"]
    clipped = weight_error(w, rtn_quantize(w, RTNConfig(3, 128, True, mse=True)).dequantize())["mse"]
    assert clipped < plain * 0.9


def test_scales_are_float16_values() -> None:
    qt = rtn_quantize(_w(), RTNConfig(4, 32, False))
    assert torch.equal(qt.scales, qt.scales.half().float())


def test_metrics_known_values() -> None:
    w = torch.tensor([[3.0, 4.0]])
    q = torch.tensor([[3.0, 3.0]])
    m = weight_error(w, q)
    assert m["mse"] == pytest.approx(0.5)
    assert m["max_abs"] == pytest.approx(1.0)
    assert m["cosine"] == pytest.approx((9 + 12) / (5 * math.sqrt(18)))
    assert m["sqnr_db"] == pytest.approx(10 * math.log10(25 / 1))
    assert weight_error(w, w)["sqnr_db"] == math.inf
