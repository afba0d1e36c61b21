"""The reference searches compiled with numba: the same float32 steps as `searches.py`, fused.

The torch searches run a C loop over a block's n elements as n vectorized steps over all blocks, so
each step is one small torch op over a chunk: thousands of ops per chunk, each a pass through memory
and a trip through the dispatcher (with the GIL held in between, so threads scale poorly). Here the
same arithmetic runs on tiles of `TILE` blocks held in L1: the inner loops go over the tile's
blocks (independent lanes that LLVM vectorizes), the outer ones over the elements in index order,
so every sum still adds its terms in C's order. Compiled without fastmath: no reassociation, no
fused multiply-add, IEEE float32 division and sqrt, and np.rint rounds half to even as ggml's
nearest_int does for the bounded arguments here. Every kernel releases the GIL.

Layout: x[B, n] row-major (block b's n elements contiguous: a weight's rows, `w.reshape(-1, n)`,
without a copy), float32, C-contiguous; levels come back the same way. `searches.py` transposes its
element-major [n, B] to call them. Importing this module imports numba; `searches.py` does so on first use.
"""

from __future__ import annotations

import numba
import numpy as np

TILE = 32  # blocks per tile: 32 lanes of float32 fill two AVX-512 registers; tiles of 32 x 32 stay in L1
F32 = np.float32
_JIT = {"nogil": True, "cache": True, "error_model": "numpy", "fastmath": False, "boundscheck": False}
# where the weights come from: the `w` argument, x² (make_qx_quants' default), or rms(x) + |x| over the
# block (the K-quants' default for make_qkx2_quants)
GIVEN, SQUARES, RMS_ABS = 0, 1, 2


@numba.njit(**_JIT)
def _load_tile(src: np.ndarray, dst: np.ndarray, b0: int, m: int) -> None:
    """dst[i, t] = src[b0 + t, i] for the tile's m live blocks; the padding lanes repeat block b0."""
    for t in range(TILE):
        b = b0 + t if t < m else b0
        for i in range(src.shape[1]):
            dst[i, t] = src[b, i]


@numba.njit(**_JIT)
def _tile_weights(x: np.ndarray, w: np.ndarray, mode: int, xt: np.ndarray, wt: np.ndarray, b0: int, m: int) -> None:
    """The tile's values, and its weights as `mode` says (C's order of operations)."""
    _load_tile(x, xt, b0, m)
    if mode == GIVEN:
        _load_tile(w, wt, b0, m)
        return
    n = xt.shape[0]
    if mode == SQUARES:
        for i in range(n):
            for t in range(TILE):
                wt[i, t] = xt[i, t] * xt[i, t]
        return
    rms = np.zeros(TILE, F32)
    for i in range(n):
        for t in range(TILE):
            rms[t] += xt[i, t] * xt[i, t]
    for t in range(TILE):
        rms[t] = np.sqrt(rms[t] / F32(n))
    for i in range(n):
        for t in range(TILE):
            wt[i, t] = rms[t] + abs(xt[i, t])


@numba.njit(**_JIT)
def qkx_search(x: np.ndarray, w: np.ndarray, mode: int, nmax: int, numerators: np.ndarray, mad: bool,
               scale_out: np.ndarray, min_out: np.ndarray, levels_out: np.ndarray) -> None:  # fmt: skip
    """make_qkx2_quants / make_qkx3_quants (see searches.make_qkx_quants): scale [B], the_min [B]
    (the negated min), levels [B, n] in [0, nmax]. `numerators[k]` is trial k's float32
    `rmin + rdelta*k + nmax`."""
    blocks, n = x.shape
    fn, zero, one = F32(nmax), F32(0.0), F32(1.0)
    xt, wt, lt = np.empty((3, n, TILE), F32)  # the tile's values, weights and one trial's levels
    # per lane: the C function's scalars
    (mn, mx, sum_w, sum_x, iscale, scale, best, best_iscale, best_shift, sum_l, sum_l2, sum_xl, this_scale, this_min,
     cur) = np.empty((15, TILE), F32)  # fmt: skip
    flat, ok = np.empty((2, TILE), np.bool_)
    for b0 in range(0, blocks, TILE):
        m = min(TILE, blocks - b0)
        _tile_weights(x, w, mode, xt, wt, b0, m)
        for t in range(TILE):
            mn[t] = xt[0, t]
            mx[t] = xt[0, t]
            sum_w[t] = zero
            sum_x[t] = zero
        for i in range(n):
            for t in range(TILE):
                v = xt[i, t]
                mn[t] = v if v < mn[t] else mn[t]
                mx[t] = v if v > mx[t] else mx[t]
                sum_w[t] += wt[i, t]
                sum_x[t] += wt[i, t] * v
        for t in range(TILE):
            mn[t] = zero if mn[t] > zero else mn[t]
            flat[t] = mx[t] <= mn[t]
            iscale[t] = fn / (one if flat[t] else mx[t] - mn[t])
            scale[t] = one / iscale[t]
            best[t] = zero
        for i in range(n):
            for t in range(TILE):
                level = min(max(np.rint((xt[i, t] - mn[t]) * iscale[t]), zero), fn)
                diff = level * scale[t] + mn[t] - xt[i, t]
                best[t] += wt[i, t] * (abs(diff) if mad else diff * diff)
        for t in range(TILE):
            best_iscale[t] = iscale[t]
            best_shift[t] = mn[t]
        for k in range(numerators.shape[0]):
            for t in range(TILE):  # measured from the best min so far: the trials run in order
                iscale[t] = numerators[k] / (one if flat[t] else mx[t] - mn[t])
                sum_l[t] = zero
                sum_l2[t] = zero
                sum_xl[t] = zero
            for i in range(n):
                for t in range(TILE):
                    level = min(max(np.rint((xt[i, t] - mn[t]) * iscale[t]), zero), fn)
                    lt[i, t] = level
                    wl = wt[i, t] * level
                    sum_l[t] += wl
                    sum_l2[t] += wl * level
                    sum_xl[t] += wl * xt[i, t]
            for t in range(TILE):
                D = sum_w[t] * sum_l2[t] - sum_l[t] * sum_l[t]
                d_safe = one if D == zero else D
                a = (sum_w[t] * sum_xl[t] - sum_x[t] * sum_l[t]) / d_safe
                b = (sum_l2[t] * sum_x[t] - sum_l[t] * sum_xl[t]) / d_safe
                positive = b > zero
                this_scale[t] = sum_xl[t] / (one if sum_l2[t] == zero else sum_l2[t]) if positive else a
                this_min[t] = zero if positive else b
                ok[t] = D > zero and not flat[t]
                cur[t] = zero
            for i in range(n):
                for t in range(TILE):
                    diff = lt[i, t] * this_scale[t] + this_min[t] - xt[i, t]
                    cur[t] += wt[i, t] * (abs(diff) if mad else diff * diff)
            for t in range(TILE):
                better = ok[t] and cur[t] < best[t]
                best_iscale[t] = iscale[t] if better else best_iscale[t]
                best_shift[t] = mn[t] if better else best_shift[t]
                best[t] = cur[t] if better else best[t]
                scale[t] = this_scale[t] if better else scale[t]
                mn[t] = this_min[t] if better else mn[t]
        for t in range(m):  # the winning trial's levels, from its inverse scale and the min it used
            for i in range(n):
                level = min(max(np.rint((xt[i, t] - best_shift[t]) * best_iscale[t]), zero), fn)
                levels_out[b0 + t, i] = zero if flat[t] else level
        for t in range(m):
            scale_out[b0 + t] = zero if flat[t] else scale[t]
            min_out[b0 + t] = -mn[t]


@numba.njit(**_JIT)
def qx_search(x: np.ndarray, w: np.ndarray, mode: int, nmax: int, numerators: np.ndarray, eps: np.float32,
              scale_out: np.ndarray, levels_out: np.ndarray) -> None:  # fmt: skip
    """make_qx_quants with rmse_type 1 (see searches.make_qx_quants): scale [B], levels [B, n] in
    [0, 2·nmax) (offset by +nmax; 0 for an all-zero block). Trial k's inverse scale is
    -numerators[k]/max, trial 0 being the plain one; a later trial wins if sumlx² > best·suml2."""
    blocks, n = x.shape
    fn, zero = F32(nmax), F32(0.0)
    lo, hi = F32(-nmax), F32(nmax - 1)
    xt, wt = np.empty((2, n, TILE), F32)
    mx, amax, iscale, best_iscale, best, scale, sumlx, suml2 = np.empty((8, TILE), F32)
    for b0 in range(0, blocks, TILE):
        m = min(TILE, blocks - b0)
        _tile_weights(x, w, mode, xt, wt, b0, m)
        for t in range(TILE):
            mx[t] = zero
            amax[t] = zero
        for i in range(n):
            for t in range(TILE):
                v = xt[i, t]
                ax = abs(v)
                bigger = ax > amax[t]
                amax[t] = ax if bigger else amax[t]
                mx[t] = v if bigger else mx[t]
        for t in range(TILE):
            mx[t] = mx[t] if amax[t] >= eps else F32(1.0)
        for k in range(numerators.shape[0]):
            for t in range(TILE):
                iscale[t] = -numerators[k] / mx[t]
                sumlx[t] = zero
                suml2[t] = zero
            for i in range(n):
                for t in range(TILE):
                    level = min(max(np.rint(iscale[t] * xt[i, t]), lo), hi)
                    sumlx[t] += wt[i, t] * xt[i, t] * level
                    suml2[t] += wt[i, t] * level * level
            if k == 0:
                for t in range(TILE):
                    nonzero = suml2[t] != zero
                    scale[t] = sumlx[t] / suml2[t] if nonzero else zero
                    best[t] = scale[t] * sumlx[t] if nonzero else zero
                    best_iscale[t] = iscale[t]
            else:
                for t in range(TILE):
                    better = suml2[t] > zero and sumlx[t] * sumlx[t] > best[t] * suml2[t]
                    this_scale = sumlx[t] / suml2[t] if better else scale[t]
                    best[t] = this_scale * sumlx[t] if better else best[t]
                    scale[t] = this_scale
                    best_iscale[t] = iscale[t] if better else best_iscale[t]
        for t in range(m):
            for i in range(n):
                level = min(max(np.rint(best_iscale[t] * xt[i, t]), lo), hi) + fn
                levels_out[b0 + t, i] = level if amax[t] >= eps else zero
        for t in range(m):
            scale_out[b0 + t] = scale[t] if amax[t] >= eps else zero


@numba.njit(**_JIT)
def requantize(x: np.ndarray, levels: np.ndarray, scale: np.ndarray, shift: np.ndarray, lo: int, hi: int, offset: int,
               codes: np.ndarray) -> None:  # fmt: skip
    """Every block against its stored scale and shift: codes[b, i] = clamp(nearest_int((x + shift)/scale),
    lo, hi) + offset, or the search's `levels` where the stored scale is 0 (x [B, n], codes uint8)."""
    flo, fhi, foff = F32(lo), F32(hi), F32(offset)
    for b in range(x.shape[0]):
        d, s = scale[b], shift[b]
        if d == F32(0.0):
            for i in range(x.shape[1]):
                codes[b, i] = np.uint8(levels[b, i])
        else:
            for i in range(x.shape[1]):
                codes[b, i] = np.uint8(min(max(np.rint((x[b, i] + s) / d), flo), fhi) + foff)


# ------------------------------------------------------------------- legacy types, no importance matrix
@numba.njit(**_JIT)
def q8_0_rows(x: np.ndarray, codes: np.ndarray, d_out: np.ndarray) -> None:
    """Q8_0 (quantize_row_q8_0_ref): d = amax/127, codes roundf(x/d) + 128 (roundf: half away from zero)."""
    for b in range(x.shape[0]):
        amax = F32(0.0)
        for i in range(x.shape[1]):
            amax = max(amax, abs(x[b, i]))
        d = amax / F32(127.0)
        inv = F32(1.0) / d if d != F32(0.0) else F32(0.0)
        d_out[b] = d
        for i in range(x.shape[1]):
            v = x[b, i] * inv
            a = abs(v)
            r = np.floor(a)
            r = r + np.floor((a - r) * F32(2.0))
            codes[b, i] = np.uint8(np.int32(np.copysign(r, v)) + 128)


@numba.njit(**_JIT)
def symmetric_rows(x: np.ndarray, half: int, codes: np.ndarray, d_out: np.ndarray) -> None:
    """Q4_0/Q5_0 (quantize_row_q4_0_ref): d = max/-half from the first value of largest magnitude,
    codes min(2·half - 1, (int)(x/d + half + 0.5))."""
    top, bias = F32(2 * half - 1), F32(half) + F32(0.5)
    for b in range(x.shape[0]):
        amax, mx = F32(0.0), F32(0.0)
        for i in range(x.shape[1]):
            a = abs(x[b, i])
            if amax < a:
                amax, mx = a, x[b, i]
        d = mx / F32(-half)
        inv = F32(1.0) / d if d != F32(0.0) else F32(0.0)
        d_out[b] = d
        for i in range(x.shape[1]):
            codes[b, i] = np.uint8(min(max(np.trunc(x[b, i] * inv + bias), F32(0.0)), top))


@numba.njit(**_JIT)
def affine_rows(x: np.ndarray, levels: int, codes: np.ndarray, d_out: np.ndarray, m_out: np.ndarray) -> None:
    """Q4_1/Q5_1 (quantize_row_q4_1_ref): d = (max - min)/levels, m = min, codes
    min(levels, (int)((x - min)/d + 0.5))."""
    top = F32(levels)
    for b in range(x.shape[0]):
        mn, mx = np.float32(np.inf), np.float32(-np.inf)
        for i in range(x.shape[1]):
            v = x[b, i]
            if v < mn:
                mn = v
            if v > mx:
                mx = v
        d = (mx - mn) / top
        inv = F32(1.0) / d if d != F32(0.0) else F32(0.0)
        d_out[b] = d
        m_out[b] = mn
        for i in range(x.shape[1]):
            codes[b, i] = np.uint8(min(max(np.trunc((x[b, i] - mn) * inv + F32(0.5)), F32(0.0)), top))
