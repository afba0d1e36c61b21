"""The FP8 E4M3 grid (`--scheme fp8-dynamic`): every e4m3 value is a code, and the QuantizedTensor's
`dequantize` is the float8 weight times its row scale exactly."""

from __future__ import annotations

import torch

from llmopt.model.packing import fp8_codes, fp8_values
from llmopt.quant.grids.fp8 import FP8, FP8_MAX


def test_every_e4m3_value_is_a_code_and_back():
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    values = values[~torch.isnan(values.float())]
    codes = fp8_codes(values)
    assert int(codes.min()) >= 0 and int(codes.max()) < 1 << FP8.bits
    assert torch.equal(fp8_values(codes).float(), values.float())


def test_quantize_is_the_float8_cast_of_the_row_scaled_weight():
    w = torch.randn(48, 96, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, 48).unsqueeze(1)
    w[5] = 0  # an all-zero row keeps scale 1
    qt = FP8.quantize(w)
    scale = w.abs().amax(1).where(w.abs().amax(1) > 0, torch.ones(48)) / FP8_MAX
    expected = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale[:, None]
    assert torch.equal(qt.dequantize(), expected)
    assert torch.equal(fp8_values(qt.codes).float() * (qt.scales * 512), expected)
    assert ((qt.dequantize() - w).abs() <= w.abs().amax(1, keepdim=True) / 16).all()  # 3 mantissa bits
    p = FP8.choose(w)  # the grid contract GPTQ rounds through gives the same codes column by column
    assert torch.equal(torch.stack([FP8.round(w[:, j], p, j) for j in range(96)], dim=1), qt.codes)
    assert torch.equal(FP8.value(qt.codes, p), qt.dequantize())
