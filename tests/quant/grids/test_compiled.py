"""The searches' one definition is the Python in grids/compiled.py; numba compiles it. Here the same
Python runs interpreted (each kernel's `py_func`, numpy float32 scalars) and the compiled kernels must
give the same bits: the compiler (no fastmath, no reassociation, no FMA) keeps C's float32 steps.

(The grids' bytes are checked against llama.cpp's in test_grids.py; this pins compiled to source.)"""

from __future__ import annotations

import numba
import numpy as np
import pytest
import torch

from llmopt.quant.grids import GRIDS, compiled
from tests.quant.grids.test_grids import edge_weights, importance

KERNELS = [name for name, f in vars(compiled).items()
           if isinstance(f, numba.core.registry.CPUDispatcher) and not name.startswith("_")]  # fmt: skip
# the lattice i-quants' searches interpreted are slow on all 24 rows: for them the ordinary, outlier, large,
# denormal, mixed and tiny rows
SLOW_INTERPRETED = {"IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S"}


def _interpreted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every public kernel replaced by its Python source (the helpers it calls stay compiled)."""
    for name in KERNELS:
        monkeypatch.setattr(compiled, name, getattr(compiled, name).py_func)


def _fields(type_name: str, w: torch.Tensor, imp: torch.Tensor | None) -> dict[str, torch.Tensor]:
    return GRIDS[type_name].chunk(w, imp)


def test_every_search_is_a_kernel() -> None:
    """The kernels this test interprets are every search the grids call."""
    assert {"qkx_search", "qx_search", "qp_search", "q3_search", "requantize", "iq4_scales", "table_codes",
            "lattice_search", "neighbour_points", "iq1_s_splits", "iq1_m_splits", "q8_0_rows", "symmetric_rows",
            "affine_rows", "row_importance_weights"} <= set(KERNELS)  # fmt: skip


def _rows(type_name: str) -> torch.Tensor:
    w = edge_weights()
    return w[[0, 4, 9, 11, 12, 14]].contiguous() if type_name in SLOW_INTERPRETED else w


@pytest.mark.parametrize("imatrix", ["none", "random"])
@pytest.mark.parametrize("type_name", sorted(GRIDS))
def test_compiled_equals_interpreted(type_name: str, imatrix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    grid = GRIDS[type_name]
    imp = importance("random" if getattr(grid, "needs_imatrix", False) else imatrix)
    w = _rows(type_name)
    got = _fields(type_name, w, imp)
    _interpreted(monkeypatch)
    with np.errstate(all="ignore"):  # interpreted float32 scalars warn where compiled code is silent (1/0, inf·0)
        ref = _fields(type_name, w, imp)
    assert ref.keys() == got.keys()
    for key in ref:
        torch.testing.assert_close(got[key], ref[key], rtol=0, atol=0, equal_nan=True)
