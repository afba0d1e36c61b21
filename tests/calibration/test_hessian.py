"""The Hessian accumulator against a direct 2/N · XᵀX in float64."""

import torch

from llmopt.calibration.hessian import STRIP, HessianAccumulator


def test_matches_full_product_over_uneven_chunks():
    torch.manual_seed(0)
    d = 2 * STRIP + 77  # strips of unequal width, and a partial last one
    x = torch.randn(1000, d) * torch.linspace(0.1, 3.0, d)
    acc = HessianAccumulator(d)
    for part in x.split((1, 300, 699)):
        acc.add(part)
    h = acc.value()
    ref = 2.0 / x.shape[0] * (x.double().t() @ x.double())
    assert torch.equal(h, h.t())
    assert torch.allclose(h.double(), ref, rtol=1e-4, atol=1e-4)


def test_cross_term_is_the_full_asymmetric_product():
    torch.manual_seed(1)
    x, x_fp = torch.randn(64, 40), torch.randn(64, 40)
    acc = HessianAccumulator(40, cross=True)
    acc.add(x[:10], x_fp[:10])
    acc.add(x[10:], x_fp[10:])
    ref = 2.0 / 64 * ((x_fp - x).double().t() @ x.double())
    assert torch.allclose(acc.cross.double(), ref, atol=1e-5)
