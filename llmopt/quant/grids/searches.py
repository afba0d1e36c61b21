"""llama.cpp's scale searches (ggml-quants.c), one definition each: the kernels in `compiled.py`.

Each search is written once, as numba-compiled float32 Python that follows the C reference step by
step (`compiled.py`); this module is its torch face: blocks in, per-block scales and integer levels
(float32 holding integers) out, same inputs giving llama.cpp's levels.

- `qx_rows` / `make_qx_quants`: symmetric levels in [-nmax, nmax), a weighted least-squares scale
  refined over 18 trial inverse scales (Q3_K/Q6_K sub-blocks, Q3_K super-scales, Q4_0/Q5_0 with an imatrix).
- `make_q3_quants`: Q3_K's symmetric search with coordinate-descent refinement of single levels.
- `qkx_rows` / `make_qkx_quants`: asymmetric levels in [0, nmax] with a min, least-squares scale and
  min over a sweep of trial scales (`make_qkx2_quants` for Q2_K/Q4_K/Q5_K, `make_qkx3_quants` with an imatrix).
- `make_qp_quants`: positive levels for the sub-block scales of imatrix-weighted K-quants.
- `requantize_rows`: codes against stored (rounded) scales.

The `*_rows` functions take blocks by rows, x[B, n] (a weight's `reshape(-1, n)`, no copy); the
`make_*` ones take them element-major, x[n, B], as the grid modules lay them out. All run on CPU
tensors: the grids bring a weight on another device to the CPU first (`layout.BlockGrid`).
"""

from __future__ import annotations

from functools import cache
from types import ModuleType

import numpy as np
import torch

from llmopt.quant.grids.numerics import GROUP_MAX_EPS, c_float, c_step


@cache
def kernels() -> ModuleType:
    """compiled.py, imported (with numba) on the first search."""
    from llmopt.quant.grids import compiled

    return compiled


def f32_array(t: torch.Tensor) -> np.ndarray:
    """A float32 C-contiguous numpy view (or copy) of a CPU tensor, for the kernels."""
    return t.detach().to(torch.float32).contiguous().numpy()


def _qx_numerators(nmax: int) -> np.ndarray:
    """make_qx_quants' trials: the plain scale -nmax/max, then -(nmax + 0.1·is)/max for is = -9..-1, 1..9, in C's order."""
    return np.array([float(nmax)] + [c_step(nmax, 0.1, s) for s in range(-9, 10) if s != 0], np.float32)


def qx_rows(x: torch.Tensor, nmax: int, weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """make_qx_quants (rmse_type 1) on blocks by rows, x [B, n]: scale [B], levels [B, n] offset by
    +nmax (0 for an all-zero block). Weights default to x²."""
    xs, k = f32_array(x), kernels()
    scale, levels = torch.empty(x.shape[0]), torch.empty(x.shape)
    k.qx_search(xs, xs if weights is None else f32_array(weights), k.SQUARES if weights is None else k.GIVEN, nmax,
                _qx_numerators(nmax), np.float32(GROUP_MAX_EPS), scale.numpy(), levels.numpy())  # fmt: skip
    return scale, levels


def qkx_rows(x: torch.Tensor, weights: torch.Tensor | None, nmax: int, rmin: float, rdelta: float, nstep: int,
             use_mad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """make_qkx_quants on blocks by rows, x [B, n]: (scale, the_min >= 0, levels [B, n]). Weights
    None: the K-quants' default rms(x) + |x| over each block."""
    xs, k = f32_array(x), kernels()
    numerators = np.array([c_float(c_step(rmin, rdelta, s) + nmax) for s in range(nstep + 1)], np.float32)
    scale, the_min, levels = torch.empty(x.shape[0]), torch.empty(x.shape[0]), torch.empty(x.shape)
    k.qkx_search(xs, xs if weights is None else f32_array(weights), k.RMS_ABS if weights is None else k.GIVEN, nmax,
                 numerators, use_mad, scale.numpy(), the_min.numpy(), levels.numpy())  # fmt: skip
    return scale, the_min, levels


def requantize_rows(x: torch.Tensor, levels: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor | None,
                    lo: int, hi: int, offset: int = 0) -> torch.Tensor:  # fmt: skip
    """Codes uint8 [B, n] of blocks x [B, n] against their stored scale [B] (and shift [B], added to x
    first): clamp(nearest_int((x + shift)/scale), lo, hi) + offset, or `levels` where the scale is 0."""
    codes = torch.empty(x.shape, dtype=torch.uint8)
    zeros = torch.zeros(x.shape[0]) if shift is None else shift
    kernels().requantize(f32_array(x), f32_array(levels), f32_array(scale), f32_array(zeros), lo, hi, offset,
                         codes.numpy())  # fmt: skip
    return codes


def make_qx_quants(x: torch.Tensor, nmax: int, weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`qx_rows` on blocks element-major, x [n, B]: scale [B], levels [n, B]."""
    scale, levels = qx_rows(x.t(), nmax, None if weights is None else weights.t())
    return scale, levels.t()


def make_qkx_quants(x: torch.Tensor, weights: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int,
                    use_mad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """`qkx_rows` on blocks element-major, x [n, B]: (scale, the_min, levels [n, B])."""
    scale, the_min, levels = qkx_rows(x.t(), weights.t(), nmax, rmin, rdelta, nstep, use_mad)
    return scale, the_min, levels.t()


def make_q3_quants(x: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q3_K's reference search (do_rmse) on x [n, B]: x²-weighted scale, then up to 5 passes moving
    single levels; levels [n, B] offset by +nmax."""
    scale, levels = torch.empty(x.shape[1]), torch.empty(x.shape[1], x.shape[0])
    kernels().q3_search(f32_array(x.t()), nmax, np.float32(GROUP_MAX_EPS), scale.numpy(), levels.numpy())
    return scale, levels.t()


def make_qp_quants(x: torch.Tensor, nmax: int, weights: torch.Tensor, wrap: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Levels in [0, nmax] for non-negative x [n, B] (sub-block scales or mins) under importance weights.
    `wrap`: x may hold negative values (IQ2_XXS's sign-flipped magnitude), whose negative levels C
    stores in uint8 L modulo 256 (and then reads back so) while its sums use them as ints."""
    numerators = np.array([c_step(nmax, 0.1, step) for step in range(-4, 5) if step != 0], np.float32)
    scale, levels = torch.empty(x.shape[1]), torch.empty(x.shape[1], x.shape[0])
    kernels().qp_search(f32_array(x.t()), f32_array(weights.t()), nmax, numerators, np.float32(GROUP_MAX_EPS), wrap,
                        scale.numpy(), levels.numpy())  # fmt: skip
    return scale, levels.t()
