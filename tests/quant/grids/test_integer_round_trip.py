"""IntGrid.round_trip, what AWQ's searches round with, is exactly quantize().dequantize() on every
kind of group (whole rows, per tensor, partial last groups, GPTQ v1's zero_min, the clipping search)."""

from __future__ import annotations

import pytest
import torch

from llmopt.quant.grids import IntGrid


@pytest.mark.parametrize("grid", [IntGrid(4, False, 128), IntGrid(3, False, 128), IntGrid(4, True, 128), IntGrid(4, False, -1),
                                  IntGrid(4, False, 0), IntGrid(4, False, 48), IntGrid(4, False, 128, zero_min=1),
                                  IntGrid(3, True, 32, mse=True), IntGrid(4, True, 128, sym_scale="tight"),
                                  IntGrid(2, True, 64, mse=True, sym_scale="tight")], ids=repr)  # fmt: skip
def test_round_trip_equals_quantize_then_dequantize(grid: IntGrid) -> None:
    g = torch.Generator().manual_seed(0)
    for shape in [(64, 576), (100, 200), (7, 50)]:
        w = torch.randn(*shape, generator=g) * 0.05
        w[0] = 0  # an all-zero row
        w[1, :10] = 3.0  # an outlier run
        w[2] = 0.01  # a constant row
        assert torch.equal(grid.round_trip(w), grid.quantize(w).dequantize(torch.float32)), shape


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_tight_symmetric_scale_puts_the_deciding_end_on_a_code(bits: int) -> None:
    """sym_scale "tight": no weight is clipped (every one within half a step of its value), and the end
    of the group that decides the scale (+max on code half-1, or -min on code -half) is a grid point
    up to the float16 rounding of the scale; GPTQ's convention leaves +max|w| half a step off."""
    g = torch.Generator().manual_seed(bits)
    w = torch.randn(96, 256, generator=g) * 0.3  # |w| < 3·(half-1)/half: the outlier below decides
    w[:48, 5] = 6.0  # rows whose largest magnitude is positive ...
    w[48:, 5] = -6.0  # ... and negative
    tight = IntGrid(bits, True, 64, sym_scale="tight").quantize(w)
    scale = tight.scales.repeat_interleave(64, dim=1)
    deq = tight.dequantize(torch.float32)
    assert torch.all((deq - w).abs() <= scale / 2 * (1 + 1e-6))
    half = 1 << (bits - 1)
    assert torch.allclose(deq[:48, 5], w[:48, 5], rtol=2e-3) and torch.all(tight.codes[:48, 5] == 2 * half - 1)
    assert torch.allclose(deq[48:, 5], w[48:, 5], rtol=2e-3) and torch.all(tight.codes[48:, 5] == 0)
    gptq = IntGrid(bits, True, 64).quantize(w).dequantize(torch.float32)
    assert torch.all((gptq[:48, 5] - w[:48, 5]).abs() > 1e-3)  # +6 falls between GPTQ's codes
