"""IntGrid.round_trip, what AWQ's searches round with, is exactly quantize().dequantize() on every
kind of group (whole rows, per tensor, partial last groups, GPTQ v1's zero_min, the clipping search)."""

from __future__ import annotations

import pytest
import torch

from llmopt.quant.grids import IntGrid


@pytest.mark.parametrize("grid", [IntGrid(4, False, 128), IntGrid(3, False, 128), IntGrid(4, True, 128), IntGrid(4, False, -1),
                                  IntGrid(4, False, 0), IntGrid(4, False, 48), IntGrid(4, False, 128, zero_min=1),
                                  IntGrid(3, True, 32, mse=True)], ids=repr)  # fmt: skip
def test_round_trip_equals_quantize_then_dequantize(grid: IntGrid) -> None:
    g = torch.Generator().manual_seed(0)
    for shape in [(64, 576), (100, 200), (7, 50)]:
        w = torch.randn(*shape, generator=g) * 0.05
        w[0] = 0  # an all-zero row
        w[1, :10] = 3.0  # an outlier run
        w[2] = 0.01  # a constant row
        assert torch.equal(grid.round_trip(w), grid.quantize(w).dequantize(torch.float32)), shape
