"""llama.cpp's scale searches (ggml-quants.c), vectorized over blocks.

Every function takes values laid out element-major, `x[n, B]` (n elements of each of B blocks), and
returns per-block scales `[B]` and integer levels `L[n, B]` (float32 holding integers), following the
C reference step by step so the same inputs give the same levels:

- `make_qx_quants`: symmetric levels in [-nmax, nmax), a weighted least-squares scale refined over
  18 trial inverse scales (Q3_K/Q6_K sub-blocks, Q3_K super-scales, Q4_0/Q5_0 with an imatrix).
- `make_q3_quants`: Q3_K's symmetric search with coordinate-descent refinement of single levels.
- `make_qkx_quants`: asymmetric levels in [0, nmax] with a min, least-squares scale and min over a
  sweep of trial scales (`make_qkx2_quants` for Q2_K/Q4_K/Q5_K, `make_qkx3_quants` with an imatrix).
- `make_qp_quants`: positive levels for the sub-block scales of imatrix-weighted K-quants.
"""

from __future__ import annotations

import sys
from functools import cache
from types import ModuleType

import numpy as np
import torch

from llmopt.quant.grids.numerics import (
    GROUP_MAX_EPS,
    c_float,
    c_max,
    c_min,
    c_sqrt,
    c_step,
    first_absmax,
    nearest_int,
    nearest_int_exact,
    positive_max,
    rounding_inverse,
    rdiv,
    safe_div,
    seq_sum,
    uint8_wrap,
)


QX_SLICE_ELEMENTS = 1 << 18  # make_qx_quants measures its 19 trials at once on slices of blocks this big (x 19)
COMPILED = True  # run the searches that have one through their numba kernel (compiled.py) on CPU tensors


@cache
def _kernels() -> ModuleType:
    """compiled.py, imported (with numba) on the first search that uses it."""
    from llmopt.quant.grids import compiled

    return compiled


def _use_compiled(x: torch.Tensor) -> bool:
    return COMPILED and x.device.type == "cpu" and x.shape[1] > 0


def compiled_for(x: torch.Tensor, if_loaded: bool = False) -> ModuleType | None:
    """The numba kernels (compiled.py) if they apply to `x` (a CPU tensor, COMPILED on), else None.
    `if_loaded`: only if already imported (where torch is nearly as fast, numba's import and first
    call, about 0.6 s, are worth paying only when some search needs them anyway)."""
    if not (COMPILED and x.device.type == "cpu" and x.numel() > 0):
        return None
    if if_loaded and "llmopt.quant.grids.compiled" not in sys.modules:
        return None
    return _kernels()


def f32_array(t: torch.Tensor) -> np.ndarray:
    """A float32 C-contiguous numpy view (or copy) of a CPU tensor, for the kernels."""
    return t.detach().to(torch.float32).contiguous().numpy()


def _qx_numerators(nmax: int) -> list[float]:
    """make_qx_quants' trials: the plain scale -nmax/max, then -(nmax + 0.1·is)/max for is = -9..-1, 1..9, in C's order."""
    return [float(nmax)] + [c_step(nmax, 0.1, s) for s in range(-9, 10) if s != 0]


def qx_rows(x: torch.Tensor, nmax: int, weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """make_qx_quants on blocks laid out by rows, x [B, n] (a weight's `reshape(-1, n)`): scale [B],
    levels [B, n] (+nmax). On CPU one compiled pass; elsewhere the torch search, transposed."""
    if not _use_compiled(x.t()):
        scale, levels = make_qx_quants(x.t().contiguous(), nmax, None if weights is None else weights.t().contiguous())
        return scale, levels.t().contiguous()
    xs = f32_array(x)
    mode = _kernels().SQUARES if weights is None else _kernels().GIVEN
    scale, levels = torch.empty(x.shape[0]), torch.empty(x.shape)
    _kernels().qx_search(xs, xs if weights is None else f32_array(weights), mode, nmax,
                         np.array(_qx_numerators(nmax), np.float32), np.float32(GROUP_MAX_EPS), scale.numpy(),
                         levels.numpy())  # fmt: skip
    return scale, levels


def qkx_rows(x: torch.Tensor, weights: torch.Tensor | None, nmax: int, rmin: float, rdelta: float, nstep: int,
             use_mad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """make_qkx_quants on blocks laid out by rows, x [B, n]: (scale, the_min, levels [B, n]). Weights
    None: the K-quants' default rms(x) + |x| over each block. On CPU one compiled pass."""
    if not _use_compiled(x.t()):
        xt = x.t().contiguous()
        w = c_sqrt(seq_sum(xt * xt) / xt.shape[0]) + xt.abs() if weights is None else weights.t().contiguous()
        scale, the_min, levels = make_qkx_quants(xt, w, nmax, rmin, rdelta, nstep, use_mad)
        return scale, the_min, levels.t().contiguous()
    xs = f32_array(x)
    mode = _kernels().RMS_ABS if weights is None else _kernels().GIVEN
    numerators = np.array([c_float(c_step(rmin, rdelta, s) + nmax) for s in range(nstep + 1)], np.float32)
    scale, the_min, levels = torch.empty(x.shape[0]), torch.empty(x.shape[0]), torch.empty(x.shape)
    _kernels().qkx_search(xs, xs if weights is None else f32_array(weights), mode, nmax, numerators, use_mad, scale.numpy(),
                          the_min.numpy(), levels.numpy())  # fmt: skip
    return scale, the_min, levels


def requantize_rows(x: torch.Tensor, levels: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor | None,
                    lo: int, hi: int, offset: int = 0) -> torch.Tensor:  # fmt: skip
    """Codes uint8 [B, n] of blocks x [B, n] against their stored scale [B] (and shift [B], added to x
    first): clamp(nearest_int((x + shift)/scale), lo, hi) + offset, or `levels` where the scale is 0."""
    if not _use_compiled(x.t()):
        d = scale[:, None]
        xs = x if shift is None else x + shift[:, None]
        requant = nearest_int(xs / torch.where(d == 0, torch.ones_like(d), d)).clamp_(lo, hi) + offset
        return torch.where(d == 0, levels, requant).to(torch.uint8)
    codes = torch.empty(x.shape, dtype=torch.uint8)
    zeros = torch.zeros(x.shape[0]) if shift is None else shift
    _kernels().requantize(f32_array(x), f32_array(levels), f32_array(scale), f32_array(zeros), lo, hi, offset,
                          codes.numpy())  # fmt: skip
    return codes


def make_qx_quants(x: torch.Tensor, nmax: int, weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric search (rmse_type 1): weights default to x², levels returned offset by +nmax.

    The 19 trial scales do not depend on each other, so their sums are measured as one batch
    [n, 19, blocks] (on slices of the blocks that keep it in cache); only the choice among them is
    sequential, as in C, and the chosen trial's levels are recomputed at the end."""
    if _use_compiled(x):
        scale, levels = qx_rows(x.t(), nmax, None if weights is None else weights.t())
        return scale, levels.t()
    n, blocks = x.shape
    w = x * x if weights is None else weights
    numerators = _qx_numerators(nmax)
    mx = first_absmax(x)
    zero = x.abs().amax(dim=0) < GROUP_MAX_EPS
    mx_safe = torch.where(zero, torch.ones_like(mx), mx)
    wx = w * x
    iscales = torch.stack([rdiv(-v, mx_safe) for v in numerators])  # [T, B]
    trials = len(numerators)
    sums = torch.empty(2, trials, blocks, device=x.device)  # Σ w·x·l and Σ w·l·l per trial and block
    step = max(1, QX_SLICE_ELEMENTS // (trials * n))
    for s in range(0, blocks, step):
        sl = slice(s, s + step)
        l = torch.mul(x[:, None, sl], iscales[None, :, sl])  # [n, T, b]
        l.round_().clamp_(-nmax, nmax - 1)
        prods = torch.empty((n, 2) + l.shape[1:], device=x.device)
        torch.mul(wx[:, None, sl], l, out=prods[:, 0])
        torch.mul(w[:, None, sl], l, out=prods[:, 1]).mul_(l)
        sums[:, :, sl] = seq_sum(prods)
    sumlx, suml2 = sums[0], sums[1]
    # sequential choice, as C: a trial wins if sumlx² > best·suml2; then scale = sumlx/suml2, best = scale·sumlx
    sq = sumlx * sumlx
    scales = safe_div(sumlx, suml2)
    values = scales * sumlx
    valid = suml2 > 0
    best = torch.where(suml2[0] != 0, values[0], torch.zeros_like(mx))
    pick = torch.zeros_like(mx, dtype=torch.int64)
    for t in range(1, trials):
        better = valid[t] & (sq[t] > best * suml2[t])
        pick.masked_fill_(better, t)
        best = torch.where(better, values[t], best)
    scale = scales.gather(0, pick[None])[0]
    scale = torch.where((pick == 0) & (suml2[0] == 0), torch.zeros_like(scale), scale)
    iscale = iscales.gather(0, pick[None])  # [1, B]
    levels = torch.mul(x, iscale).round_().clamp_(-nmax, nmax - 1).add_(nmax)
    levels = torch.where(zero, torch.zeros_like(levels), levels)
    return torch.where(zero, torch.zeros_like(scale), scale), levels


def make_q3_quants(x: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q3_K's reference search (do_rmse): x²-weighted scale, then up to 5 passes moving single levels."""
    if _use_compiled(x):
        scale, levels = torch.empty(x.shape[1]), torch.empty(x.shape[1], x.shape[0])
        _kernels().q3_search(f32_array(x.t()), nmax, np.float32(GROUP_MAX_EPS), scale.numpy(), levels.numpy())
        return scale, levels.t()
    mx = first_absmax(x)
    zero = x.abs().amax(dim=0) < GROUP_MAX_EPS
    iscale = rdiv(-float(nmax), torch.where(zero, torch.ones_like(mx), mx))
    L = nearest_int(iscale * x).clamp_(-nmax, nmax - 1)
    w = x * x
    wx = w * x
    sumlx = seq_sum(wx * L)
    suml2 = seq_sum(w * L * L)
    sumlx, suml2 = _move_single_levels(x, w, L, sumlx, suml2, -nmax, nmax - 1, require_sl2_first=False)
    scale = torch.where(suml2 > 0, safe_div(sumlx, suml2), torch.zeros_like(sumlx))
    levels = torch.where(zero, torch.zeros_like(L), L + nmax)
    return torch.where(zero, torch.zeros_like(scale), scale), levels


def _move_single_levels(x: torch.Tensor, w: torch.Tensor, L: torch.Tensor, sumlx: torch.Tensor, suml2: torch.Tensor,
                        lo: int | None, hi: int, require_sl2_first: bool,
                        wrap: bool = False) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Up to 5 passes over the elements in order, moving one level at a time to the value that
    best fits the others' least-squares scale, keeping a move only if it raises sumlx²/suml2.
    Updates L in place and returns the final (sumlx, suml2). make_q3_quants checks suml2 of the
    move after it; make_qp_quants checks the remaining suml2 before it. `wrap`: L holds C's uint8
    levels (a negative level stored modulo 256), while the sums take the new level as the int it is."""
    wx = w * x
    for _ in range(5):
        changed = torch.zeros_like(sumlx, dtype=torch.bool)
        for i in range(x.shape[0]):
            slx = sumlx - wx[i] * L[i]
            sl2 = suml2 - w[i] * L[i] * L[i]
            ok = (slx > 0) & (sl2 > 0) if require_sl2_first else slx > 0
            new_l = nearest_int_exact(x[i] * sl2 / torch.where(ok, slx, torch.ones_like(slx))).clamp_(lo, hi)
            cand = ok & (new_l != L[i])
            slx = slx + wx[i] * new_l
            sl2 = sl2 + w[i] * new_l * new_l
            accept = cand & (slx * slx * suml2 > sumlx * sumlx * sl2)
            if not require_sl2_first:
                accept &= sl2 > 0
            L[i] = torch.where(accept, uint8_wrap(new_l) if wrap else new_l, L[i])
            sumlx = torch.where(accept, slx, sumlx)
            suml2 = torch.where(accept, sl2, suml2)
            changed |= accept
        if not bool(changed.any()):
            break
    return sumlx, suml2


def make_qkx_quants(
    x: torch.Tensor, weights: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int, use_mad: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric search (make_qkx2_quants / make_qkx3_quants): returns (scale, the_min >= 0, levels).

    Each trial inverse scale is measured from the best min found so far, so the trials run in order;
    within a trial the three weighted sums share one pass ([n, 3, blocks], summed in index order).
    """
    w = weights
    if _use_compiled(x):
        scale, the_min, levels = qkx_rows(x.t(), w.t(), nmax, rmin, rdelta, nstep, use_mad)
        return scale, the_min, levels.t()
    mn = c_min(x)
    mn = torch.where(mn > 0, torch.zeros_like(mn), mn)
    mx = c_max(x)
    flat = mx <= mn
    active = ~flat
    sum_w = seq_sum(w)
    sum_x = seq_sum(w * x)
    n = x.shape[0]
    prods = torch.empty((n, 3, x.shape[1]), device=x.device)  # w·l, w·l·l, w·l·x of one trial
    diff = torch.empty_like(x)

    def error(scale: torch.Tensor, minimum: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
        torch.mul(levels, scale, out=diff).add_(minimum).sub_(x)  # scale·l + min - x
        diff.abs_() if use_mad else diff.mul_(diff)
        return seq_sum(diff.mul_(w))

    def levels_for(iscale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
        return nearest_int(torch.sub(x, minimum).mul_(rounding_inverse(iscale))).clamp_(0, nmax)

    rng = torch.where(flat, torch.ones_like(mx), mx - mn)
    iscale = rdiv(float(nmax), rng)
    scale = rdiv(1.0, iscale)
    best = error(scale, mn, levels_for(iscale, mn))
    # the winning trial's levels are recomputed at the end from its inverse scale and the min it used
    best_iscale, best_shift = iscale, mn
    for step in range(nstep + 1):
        iscale = c_step(rmin, rdelta, step) + nmax
        iscale = rdiv(c_float(iscale), torch.where(flat, torch.ones_like(mx), mx - mn))
        l = levels_for(iscale, mn)
        wl = torch.mul(w, l, out=prods[:, 0])
        torch.mul(wl, l, out=prods[:, 1])
        torch.mul(wl, x, out=prods[:, 2])
        sum_l, sum_l2, sum_xl = seq_sum(prods).unbind(0)
        D = sum_w * sum_l2 - sum_l * sum_l
        D_safe = torch.where(D == 0, 1.0, D)
        this_scale = (sum_w * sum_xl - sum_x * sum_l).div_(D_safe)
        this_min = (sum_l2 * sum_x - sum_l * sum_xl).div_(D_safe)
        positive = this_min > 0
        this_scale = torch.where(positive, safe_div(sum_xl, sum_l2), this_scale)
        this_min = torch.where(positive, 0.0, this_min)
        cur = error(this_scale, this_min, l)
        better = (D > 0).logical_and_(cur < best).logical_and_(active)
        best_iscale = torch.where(better, iscale, best_iscale)
        best_shift = torch.where(better, mn, best_shift)
        best = torch.where(better, cur, best)
        scale = torch.where(better, this_scale, scale)
        mn = torch.where(better, this_min, mn)
    L = levels_for(best_iscale, best_shift)
    L = torch.where(flat, torch.zeros_like(L), L)
    scale = torch.where(flat, torch.zeros_like(scale), scale)
    return scale, -mn, L


def make_qp_quants(x: torch.Tensor, nmax: int, weights: torch.Tensor, wrap: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Levels in [0, nmax] for non-negative x (sub-block scales or mins) under importance weights.
    `wrap`: x may hold negative values (IQ2_XXS's sign-flipped magnitude), whose negative levels C
    stores in uint8 L modulo 256 (and then reads back so) while its sums use them as ints."""
    w = weights
    if _use_compiled(x):
        numerators = np.array([c_step(nmax, 0.1, step) for step in range(-4, 5) if step != 0], np.float32)
        scale, levels = torch.empty(x.shape[1]), torch.empty(x.shape[1], x.shape[0])
        _kernels().qp_search(f32_array(x.t()), f32_array(w.t()), nmax, numerators, np.float32(GROUP_MAX_EPS), wrap,
                             scale.numpy(), levels.numpy())  # fmt: skip
        return scale, levels.t()
    mx = positive_max(x, dim=0)
    zero = mx < GROUP_MAX_EPS
    mx_safe = torch.where(zero, torch.ones_like(mx), mx)

    def mse(scale: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
        diff = x - scale * levels
        return seq_sum(w * diff * diff)

    iscale = rdiv(float(nmax), mx_safe)
    first = nearest_int(iscale * x)
    best = mse(rdiv(1.0, iscale), uint8_wrap(first) if wrap else first)
    for step in range(-4, 5):
        if step == 0:
            continue
        iscale_is = rdiv(c_step(nmax, 0.1, step), mx_safe)
        cur = mse(rdiv(1.0, iscale_is), nearest_int(iscale_is * x).clamp_(max=nmax))
        better = cur < best
        best = torch.where(better, cur, best)
        iscale = torch.where(better, iscale_is, iscale)
    L = nearest_int(iscale * x).clamp_(max=nmax)
    wx = w * x
    sumlx = seq_sum(wx * L)
    suml2 = seq_sum(w * L * L)
    if wrap:
        L = uint8_wrap(L)
    sumlx, suml2 = _move_single_levels(x, w, L, sumlx, suml2, None, nmax, require_sl2_first=True, wrap=wrap)
    scale = torch.where(suml2 > 0, safe_div(sumlx, suml2), torch.zeros_like(sumlx))
    L = torch.where(zero, torch.zeros_like(L), L)
    return torch.where(zero, torch.zeros_like(scale), scale), L
