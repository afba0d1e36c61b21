"""`QuantizedTensor`: slicing rows keeps every field, so stacked linears split and GGUF's Q/K rows
permute without losing a grid's raw fields."""

import torch

from llmopt.quant.grids import GRIDS, IntGrid


def test_take_rows_keeps_every_field_of_an_integer_grid() -> None:
    w = torch.randn(12, 64, generator=torch.Generator().manual_seed(0))
    qt = IntGrid(4, sym=False, group_size=32).quantize(w)
    part = qt.take_rows(slice(4, 8))
    assert torch.equal(part.dequantize(), qt.dequantize()[4:8])
    assert part.zeros is not None and part.zeros.shape == (4, 2) and part.grid == "int"


def test_take_rows_keeps_a_gguf_grids_raw_fields() -> None:
    w = torch.randn(8, 256, generator=torch.Generator().manual_seed(1))
    qt = GRIDS["Q4_K"].quantize(w)
    order = torch.tensor([3, 1, 7, 0])
    part = qt.take_rows(order)
    assert set(part.aux) == {"d", "dmin", "sc", "m"}
    for name, field in part.aux.items():
        assert torch.equal(field, qt.aux[name][order]), name
    assert torch.equal(part.dequantize(), qt.dequantize()[order])


def test_per_tensor_parameters_are_shared_by_every_row() -> None:
    qt = IntGrid(8, sym=True, group_size=0).quantize(torch.randn(6, 32))
    part = qt.take_rows(slice(0, 3))
    assert part.scales.shape == (1, 1) and torch.equal(part.dequantize(), qt.dequantize()[:3])
