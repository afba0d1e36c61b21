"""llama.cpp's reference searches (ggml-quants.c), each defined once: float32 Python compiled with numba.

This module is the one definition of every GGUF search (the grids and `searches.py` call it; a
weight on another device comes to the CPU for it, `layout.BlockGrid`). Written as torch ops, a C
loop over a block's n elements would be n small vectorized steps, each a pass through memory and a
trip through the dispatcher; here the arithmetic runs on tiles of `TILE` blocks held in L1: the
inner loops go over the tile's blocks (independent lanes that LLVM vectorizes), the outer ones over
the elements in index order, so every sum still adds its terms in C's order. Compiled without
fastmath: no reassociation, no fused multiply-add, IEEE float32 division and sqrt, and np.rint rounds
half to even as ggml's nearest_int does for the bounded arguments here. Every kernel releases the GIL. The kernels are
plain Python too: `tests/quant/grids/test_compiled.py` runs them uncompiled (numba's `py_func`) and
checks that the compiled code gives the same bits.

Layout: x[B, n] row-major (block b's n elements contiguous: a weight's rows, `w.reshape(-1, n)`,
without a copy), float32, C-contiguous; levels come back the same way. `searches.py` transposes its
element-major [n, B] to call them. Importing this module imports numba; `searches.kernels()` does so on first use.
"""

from __future__ import annotations

import numba
import numpy as np

TILE = 32  # blocks per tile: 32 lanes of float32 fill two AVX-512 registers; tiles of 32 x 32 stay in L1
F32 = np.float32
_FLT_MAX = np.float32(np.finfo(np.float32).max)
_JIT = {"nogil": True, "cache": True, "error_model": "numpy", "fastmath": False, "boundscheck": False}
# where the weights come from: the `w` argument, x² (make_qx_quants' default), or rms(x) + |x| over the
# block (the K-quants' default for make_qkx2_quants)
GIVEN, SQUARES, RMS_ABS = 0, 1, 2


@numba.njit(inline="always", **_JIT)  # called per block: no call overhead
def _rounding_inverse(iscale: np.float32) -> np.float32:
    """An inverse scale to round `(x - min)·iscale` with, clamped at level 0 after: 0 where it overflowed
    (a block of float32 denormals; C's nearest_int turns the ±inf and NaN products into level 0 too)."""
    return iscale if abs(iscale) <= _FLT_MAX else F32(0.0)


@numba.njit(inline="always", **_JIT)  # called per element: no call overhead
def _low_byte(v: np.float32) -> np.float32:
    """C's (int8_t)/(uint8_t) cast on x86 of ±inf or NaN (1/d of a denormal block) keeps INT_MIN's low byte, 0."""
    return v if abs(v) <= _FLT_MAX else F32(0.0)


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
def _tile_absmax(xt: np.ndarray, mx: np.ndarray, amax: np.ndarray, eps: np.float32) -> None:
    """Per lane, the largest magnitude `amax` and the first value that has it `mx` (C: `if (ax > amax)`),
    `mx` set to 1 where amax < eps (a block the caller stores as zeros)."""
    for t in range(TILE):
        mx[t] = F32(0.0)
        amax[t] = F32(0.0)
    for i in range(xt.shape[0]):
        for t in range(TILE):
            a = abs(xt[i, t])
            bigger = a > amax[t]
            amax[t] = a if bigger else amax[t]
            mx[t] = xt[i, t] if bigger else mx[t]
    for t in range(TILE):
        mx[t] = mx[t] if amax[t] >= eps else F32(1.0)


@numba.njit(**_JIT)
def qkx_search(x: np.ndarray, w: np.ndarray, mode: int, nmax: int, numerators: np.ndarray, mad: bool,
               scale_out: np.ndarray, min_out: np.ndarray, levels_out: np.ndarray) -> None:  # fmt: skip
    """make_qkx2_quants / make_qkx3_quants, the asymmetric search: scale [B], the_min [B] (the negated
    min), levels [B, n] in [0, nmax]. `numerators[k]` is trial k's float32 `rmin + rdelta*k + nmax`.
    Each trial inverse scale is measured from the best min so far, so the trials run in order; the
    winning trial's levels are recomputed at the end from its inverse scale and the min it used."""
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
            iscale[t] = _rounding_inverse(iscale[t])
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
                iscale[t] = _rounding_inverse(numerators[k] / (one if flat[t] else mx[t] - mn[t]))
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
    """make_qx_quants with rmse_type 1, the symmetric search: scale [B], levels [B, n] in
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
        _tile_absmax(xt, mx, amax, eps)
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


# --------------------------------------------------------------------------- legacy types' imatrix weights
@numba.njit(**_JIT)
def row_importance_weights(x: np.ndarray, importance: np.ndarray, out: np.ndarray) -> None:
    """The legacy types' imatrix weights (quantize_row_q4_0_impl and its kin): importance[j]·sqrtf(σ² + x²)
    with σ² = Σx²/n over each whole row of x [rows, cols], summed in index order."""
    rows, cols = x.shape
    n = F32(cols)
    for r in range(rows):
        sum_x2 = F32(0.0)
        for j in range(cols):
            sum_x2 += x[r, j] * x[r, j]
        sigma2 = sum_x2 / n
        for j in range(cols):
            out[r, j] = importance[j] * np.sqrt(sigma2 + x[r, j] * x[r, j])


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
            codes[b, i] = np.uint8(np.int32(_low_byte(np.copysign(r, v))) + 128)


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
            codes[b, i] = np.uint8(min(max(_low_byte(np.trunc(x[b, i] * inv + bias)), F32(0.0)), top))


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
            codes[b, i] = np.uint8(min(max(_low_byte(np.trunc((x[b, i] - mn) * inv + F32(0.5))), F32(0.0)), top))


# ------------------------------------------------------------------------------ IQ4_NL / IQ4_XS
@numba.njit(inline="always", **_JIT)  # called per element or group: no call overhead
def _table_level(a: np.float32, cell_value: np.ndarray, lowest: int) -> np.float32:
    """The table level nearest to a (llama.cpp's best_index_int8): the level of a's half-integer cell
    (`iq4.Levels` builds `cell_value` and checks that rounding is constant on every cell)."""
    cell = min(max(np.floor(a * F32(2.0)), F32(lowest)), F32(lowest + cell_value.shape[0] - 1))
    return cell_value[np.int64(cell) - lowest]


@numba.njit(**_JIT)
def iq4_scales(x: np.ndarray, w: np.ndarray, mode: int, cell_value: np.ndarray, lowest: int, v0: np.float32,
               ntry: int, eps: np.float32, scale_out: np.ndarray) -> None:  # fmt: skip
    """quantize_row_iq4_nl_impl's sub-block scale (IQ4_NL/IQ4_XS), blocks by rows: trial 0
    is -max/v0 inverted, then (t + v0)/max for t = -ntry..ntry; a trial wins when its Σwqx²/Σwq²
    beats the best so far."""
    blocks, n = x.shape
    zero = F32(0.0)
    xt, wt = np.empty((2, n, TILE), F32)
    mx, amax, iscale, d, best, sumqx, sumq2 = np.empty((7, TILE), F32)
    for b0 in range(0, blocks, TILE):
        m = min(TILE, blocks - b0)
        _tile_weights(x, w, mode, xt, wt, b0, m)
        _tile_absmax(xt, mx, amax, eps)
        for k in range(2 * ntry + 2):
            for t in range(TILE):
                iscale[t] = F32(1.0) / (-mx[t] / v0) if k == 0 else (F32(k - 1 - ntry) + v0) / mx[t]
                sumqx[t] = zero
                sumq2[t] = zero
            for i in range(n):
                for t in range(TILE):
                    q = _table_level(xt[i, t] * iscale[t], cell_value, lowest)
                    wq = wt[i, t] * q
                    sumqx[t] += wq * xt[i, t]
                    sumq2[t] += wq * q
            for t in range(TILE):
                valid = sumq2[t] > zero
                if k == 0:
                    d[t] = sumqx[t] / sumq2[t] if valid else zero
                    best[t] = d[t] * sumqx[t]
                elif valid and sumqx[t] * sumqx[t] > best[t] * sumq2[t]:
                    d[t] = sumqx[t] / sumq2[t]
                    best[t] = d[t] * sumqx[t]
        for t in range(m):
            scale_out[b0 + t] = d[t] if amax[t] >= eps else zero


@numba.njit(**_JIT)
def table_codes(x: np.ndarray, inv_scale: np.ndarray, cell_value: np.ndarray, lowest: int, offset: int,
                codes: np.ndarray) -> None:  # fmt: skip
    """codes[b, i] = the table level nearest to x[b, i]·inv_scale[b], plus `offset` (uint8)."""
    for b in range(x.shape[0]):
        for i in range(x.shape[1]):
            codes[b, i] = np.uint8(np.int32(_table_level(x[b, i] * inv_scale[b], cell_value, lowest)) + offset)


# -------------------------------------------------------------------- IQ3_XXS / IQ2_XXS / ... lattices
@numba.njit(inline="always", **_JIT)  # called per element or group: no call overhead
def _nearest_int_exact(v: np.float32, bits: np.ndarray) -> np.float32:
    """ggml's nearest_int bit for bit (its wrap-around outside |v| <= 2^22 included); `bits` is a
    float32 scratch of one element with an int32 view after it."""
    if abs(v) < F32(4194304.0):  # |v| < 2^22: 1.5·2^23 + v rounds to an integer half to even, so this is rint
        return np.rint(v)
    bits[0] = v + F32(12582912.0)
    return F32((bits.view(np.int32)[0] & 0x007FFFFF) - 0x00400000)


@numba.njit(inline="always", **_JIT)  # called per group: no call overhead
def _best_neighbour(x: np.ndarray, w: np.ndarray, values: np.ndarray, scale: np.float32, start: int,
                    neighbours: np.ndarray, coords: np.ndarray, terms: np.ndarray) -> int:  # fmt: skip
    """llama.cpp's iq2/iq3_find_best_neighbour for one group, x and w its `dims` values and weights, whose candidates
    are neighbours[start + 1 ...] (neighbours[start] of them, Lattice.compact_map): the first with the least
    Σ (q·scale - x)·w·(q·scale - x) in coordinate order, q = values[level] (torch's argmin: the first NaN
    wins). -1 without candidates. `terms` [dims, levels] is scratch."""
    best, best_d2 = -1, F32(0.0)
    nlevels = values.shape[0]
    count = neighbours[start] if start >= 0 else 0
    tabled = count > nlevels  # many candidates (IQ2's): each coordinate's error once per level, then looked up
    if tabled:
        for i in range(x.shape[0]):
            for lv in range(nlevels):
                diff = values[lv] * scale - x[i]
                terms[i, lv] = diff * w[i] * diff
    for c in range(count):
        p = neighbours[start + 1 + c]
        d2 = F32(0.0)
        if tabled:
            for i in range(x.shape[0]):
                d2 += terms[i, coords[p, i]]
        else:
            for i in range(x.shape[0]):
                diff = values[coords[p, i]] * scale - x[i]
                d2 += diff * w[i] * diff
        if d2 != d2:
            return p
        if best < 0 or d2 < best_d2:
            best, best_d2 = p, d2
    return best


@numba.njit(**_JIT)
def neighbour_points(keys: np.ndarray, x: np.ndarray, w: np.ndarray, scale: np.ndarray, values: np.ndarray,
                     kmap: np.ndarray, neighbours: np.ndarray, coords: np.ndarray, out: np.ndarray) -> None:  # fmt: skip
    """llama.cpp's find_best_neighbour (`lattice.Lattice.best_neighbour`) for groups one by one: keys [m] (off the lattice), x/w [m, dims],
    scale [m], values [m or 1, levels] (what level l stands for) -> each group's best neighbour."""
    terms = np.empty((x.shape[1], values.shape[1]), F32)
    for r in range(keys.shape[0]):
        v = values[r if values.shape[0] > 1 else 0]
        out[r] = _best_neighbour(x[r], w[r], v, scale[r], -kmap[keys[r]] - 1, neighbours, coords, terms)


@numba.njit(**_JIT)
def _lattice_round(xt: np.ndarray, wat: np.ndarray, inv: np.ndarray, scale: np.ndarray, lane_on: np.ndarray,
                   only: np.ndarray, use_only: bool, nmax: int, dims: int, nbits: int, index_of_key: np.ndarray,
                   neighbours: np.ndarray, values: np.ndarray, coords: np.ndarray,
                   levels: np.ndarray, off: np.ndarray, scratch: np.ndarray) -> None:  # fmt: skip
    """One trial's rounding of a tile (quantize_row_iq3_xxs_impl's inner loop): every group's lattice point at inverse scale inv[t]
    (an off-lattice group of a lane that is on: its best neighbour at scale[t], if searched, level l
    standing for values[l]; else point 0), as levels [n, TILE], and which groups were off [groups, TILE]."""
    n = xt.shape[0]
    top, zero = F32(nmax - 1), F32(0.0)
    terms = np.empty((dims, nmax), F32)  # _best_neighbour's per-level errors
    wide = 0
    for i in range(n):  # nearest_int((inv·x - 1)/2): rint, unless some value needs its wrap-around (or is NaN)
        for t in range(TILE):
            v = (inv[t] * xt[i, t] - F32(1.0)) * F32(0.5)
            wide += np.int32(not abs(v) < F32(4194304.0))
            levels[i, t] = min(max(np.rint(v), zero), top)
    if wide:
        for i in range(n):
            for t in range(TILE):
                v = (inv[t] * xt[i, t] - F32(1.0)) * F32(0.5)
                levels[i, t] = min(max(_nearest_int_exact(v, scratch), zero), top)
    for g in range(n // dims):
        for t in range(TILE):
            key = 0
            for i in range(dims):
                key += np.int64(levels[g * dims + i, t]) << (nbits * i)
            index = index_of_key[key]
            off[g, t] = index < 0
            if index < 0:  # not a point: the best neighbour's levels, or point 0's where not searched
                if lane_on[t] and (not use_only or only[g, t]) and neighbours[-index - 1] > 0:
                    index = _best_neighbour(xt[g * dims:(g + 1) * dims, t], wat[g * dims:(g + 1) * dims, t], values,
                                            scale[t], -index - 1, neighbours, coords, terms)  # fmt: skip
                index = max(index, 0)
                for i in range(dims):
                    levels[g * dims + i, t] = F32(coords[index, i])


@numba.njit(**_JIT)
def _lattice_sums(wt: np.ndarray, xt: np.ndarray, levels: np.ndarray, sumqx: np.ndarray, sumq2: np.ndarray) -> None:
    """Per lane Σ w·x·q and Σ w·q·q with q = 2l + 1, from +0 in element order."""
    for t in range(TILE):
        sumqx[t] = F32(0.0)
        sumq2[t] = F32(0.0)
    for i in range(levels.shape[0]):
        for t in range(TILE):
            q = levels[i, t] * F32(2.0) + F32(1.0)
            sumqx[t] += wt[i, t] * xt[i, t] * q
            sumq2[t] += wt[i, t] * q * q


@numba.njit(**_JIT)
def lattice_search(xval: np.ndarray, weight: np.ndarray, waux: np.ndarray, base: np.ndarray, scale0: np.ndarray,
                   active: np.ndarray, numerators: np.ndarray, requant: int, nmax: int, dims: int, nbits: int,
                   index_of_key: np.ndarray, neighbours: np.ndarray, coords: np.ndarray, scale_out: np.ndarray,
                   levels_out: np.ndarray) -> None:  # fmt: skip
    """The lattice i-quants' sub-block search (iq_lattice.LatticeGrid._search): the trials and re-rounding, sub-blocks by rows [S, n], on
    tiles of TILE sub-blocks: trial k's inverse scale is numerators[k]/base; the best Σwqx²/Σwq² wins;
    then groups are rounded again against the winning scale (`requant` 0: the off-lattice ones, 1: all,
    2: all if any was off) and the scale refitted. Writes the raw scale (before the sign flip and the
    inactive mask) and the levels."""
    blocks, n = xval.shape
    groups = n // dims
    zero = F32(0.0)
    xt, wt, wat, lt, best_l = np.empty((5, n, TILE), F32)
    inv, sc, scale, best, sumqx, sumq2, base_t = np.empty((7, TILE), F32)
    off, on_grid, regroup = np.empty((3, groups, TILE), np.bool_)
    on, better, redo = np.empty((3, TILE), np.bool_)
    scratch = np.empty(1, F32)
    values = np.empty(nmax, F32)  # level l stands for 2l + 1 in the search
    for lv in range(nmax):
        values[lv] = F32(2 * lv + 1)
    for b0 in range(0, blocks, TILE):
        m = min(TILE, blocks - b0)
        _load_tile(xval, xt, b0, m)
        _load_tile(weight, wt, b0, m)
        _load_tile(waux, wat, b0, m)
        for t in range(TILE):
            b = b0 + t if t < m else b0
            on[t] = active[b] and t < m
            base_t[t], scale[t], best[t] = base[b], scale0[b], zero
        best_l[:] = zero
        on_grid[:] = requant != 2
        if on.any():
            for k in range(numerators.shape[0]):
                for t in range(TILE):
                    inv[t] = numerators[k] / base_t[t]
                    sc[t] = F32(1.0) / inv[t]
                _lattice_round(xt, wat, inv, sc, on, regroup, False, nmax, dims, nbits, index_of_key, neighbours,
                               values, coords, lt, off, scratch)  # fmt: skip
                _lattice_sums(wt, xt, lt, sumqx, sumq2)
                for t in range(TILE):
                    better[t] = on[t] and sumq2[t] > zero and sumqx[t] * sumqx[t] > best[t] * sumq2[t]
                    if better[t]:
                        scale[t] = sumqx[t] / sumq2[t]
                        best[t] = scale[t] * sumqx[t]
                for i in range(n):
                    for t in range(TILE):
                        best_l[i, t] = lt[i, t] if better[t] else best_l[i, t]
                for g in range(groups):
                    for t in range(TILE):
                        on_grid[g, t] = (not off[g, t]) if better[t] else on_grid[g, t]
            for t in range(TILE):
                redo[t] = on[t] and scale[t] > zero and (requant == 1 or not on_grid[:, t].all())
                sc[t] = scale[t] if redo[t] else F32(1.0)
                inv[t] = F32(1.0) / sc[t]
            if redo.any():
                for g in range(groups):
                    for t in range(TILE):
                        regroup[g, t] = redo[t] and (requant != 0 or not on_grid[g, t])
                _lattice_round(xt, wat, inv, sc, redo, regroup, True, nmax, dims, nbits, index_of_key, neighbours,
                               values, coords, lt, off, scratch)  # fmt: skip
                for g in range(groups):
                    for i in range(dims):
                        for t in range(TILE):
                            if regroup[g, t]:
                                best_l[g * dims + i, t] = lt[g * dims + i, t]
                _lattice_sums(wt, xt, best_l, sumqx, sumq2)
                for t in range(TILE):
                    if redo[t] and sumq2[t] > zero:
                        scale[t] = sumqx[t] / sumq2[t]
        for t in range(m):
            scale_out[b0 + t] = scale[t]
            for i in range(n):
                levels_out[b0 + t, i] = best_l[i, t]


# ----------------------------------------------------------------------------------- make_qp_quants
@numba.njit(inline="always", **_JIT)  # called per element or group: no call overhead
def _wrap_u8(v: np.float32) -> np.float32:
    """C's `(uint8_t) int` of an integer-valued float: modulo 256."""
    return v - F32(256.0) * np.floor(v / F32(256.0))


@numba.njit(**_JIT)
def qp_search(x: np.ndarray, w: np.ndarray, nmax: int, numerators: np.ndarray, eps: np.float32, wrap: bool,
              scale_out: np.ndarray, levels_out: np.ndarray) -> None:  # fmt: skip
    """make_qp_quants, blocks by rows [B, n]: the plain inverse scale
    nmax/max, trials numerators[k]/max chosen by the least weighted squared error, then up to 5
    passes moving single levels. `wrap`: levels are kept modulo 256 (C's uint8 L) while the sums
    take each new level as the int it is."""
    blocks, n = x.shape
    fn, zero = F32(nmax), F32(0.0)
    L = np.empty(n, F32)
    scratch = np.empty(1, F32)
    for b in range(blocks):
        xs, ws = x[b], w[b]
        mx = zero
        for i in range(n):
            mx = xs[i] if xs[i] > mx else mx
        if mx < eps:
            scale_out[b] = zero
            levels_out[b] = zero
            continue
        iscale = fn / mx
        scale = F32(1.0) / iscale
        best = zero
        for i in range(n):
            level = np.rint(iscale * xs[i])
            diff = xs[i] - scale * (_wrap_u8(level) if wrap else level)
            best += ws[i] * diff * diff
        for k in range(numerators.shape[0]):
            iscale_k = numerators[k] / mx
            scale_k = F32(1.0) / iscale_k
            cur = zero
            for i in range(n):
                diff = xs[i] - scale_k * min(np.rint(iscale_k * xs[i]), fn)
                cur += ws[i] * diff * diff
            if cur < best:
                best, iscale = cur, iscale_k
        sumlx, suml2 = zero, zero
        for i in range(n):
            L[i] = min(np.rint(iscale * xs[i]), fn)
            sumlx += ws[i] * xs[i] * L[i]
            suml2 += ws[i] * L[i] * L[i]
            if wrap:
                L[i] = _wrap_u8(L[i])
        for _ in range(5):
            changed = False
            for i in range(n):
                wx = ws[i] * xs[i]
                slx = sumlx - wx * L[i]
                sl2 = suml2 - ws[i] * L[i] * L[i]
                if slx > zero and sl2 > zero:
                    new_l = min(_nearest_int_exact(xs[i] * sl2 / slx, scratch), fn)
                    if new_l != L[i]:
                        slx = slx + wx * new_l
                        sl2 = sl2 + ws[i] * new_l * new_l
                        if slx * slx * suml2 > sumlx * sumlx * sl2:
                            L[i] = _wrap_u8(new_l) if wrap else new_l
                            sumlx, suml2 = slx, sl2
                            changed = True
            if not changed:
                break
        scale_out[b] = sumlx / suml2 if suml2 > zero else zero
        levels_out[b] = L


# ----------------------------------------------------------------------------------- make_q3_quants
@numba.njit(**_JIT)
def q3_search(x: np.ndarray, nmax: int, eps: np.float32, scale_out: np.ndarray, levels_out: np.ndarray) -> None:
    """make_q3_quants with do_rmse, blocks by rows [B, n]: the inverse
    scale -nmax over the signed value of largest magnitude, x²-weighted sums, then up to 5 passes
    moving single levels; levels come back offset by +nmax."""
    blocks, n = x.shape
    lo, hi, zero = F32(-nmax), F32(nmax - 1), F32(0.0)
    L = np.empty(n, F32)
    scratch = np.empty(1, F32)
    for b in range(blocks):
        xs = x[b]
        amax, mx = zero, zero
        for i in range(n):
            ax = abs(xs[i])
            if ax > amax:
                amax, mx = ax, xs[i]
        if amax < eps:
            scale_out[b] = zero
            levels_out[b] = zero
            continue
        iscale = F32(-nmax) / mx
        sumlx, suml2 = zero, zero
        for i in range(n):
            L[i] = min(max(np.rint(iscale * xs[i]), lo), hi)
            w = xs[i] * xs[i]
            sumlx += w * xs[i] * L[i]
            suml2 += w * L[i] * L[i]
        for _ in range(5):
            changed = False
            for i in range(n):
                w = xs[i] * xs[i]
                slx = sumlx - w * xs[i] * L[i]
                if slx > zero:
                    sl2 = suml2 - w * L[i] * L[i]
                    new_l = min(max(_nearest_int_exact(xs[i] * sl2 / slx, scratch), lo), hi)
                    if new_l != L[i]:
                        slx = slx + w * xs[i] * new_l
                        sl2 = sl2 + w * new_l * new_l
                        if sl2 > zero and slx * slx * suml2 > sumlx * sumlx * sl2:
                            L[i] = new_l
                            sumlx, suml2 = slx, sl2
                            changed = True
            if not changed:
                break
        scale_out[b] = sumlx / suml2 if suml2 > zero else zero
        for i in range(n):
            levels_out[b, i] = L[i] + F32(nmax)
# ------------------------------------------------------------------------------ IQ1_S / IQ1_M split scan
@numba.njit(**_JIT)
def _load_prefix(src: np.ndarray, dst: np.ndarray, b0: int, m: int) -> None:
    """dst[j + 1, t] = dst[j, t] + src[b0 + t, j] from dst[0] = +0 (padding lanes repeat block b0)."""
    for t in range(TILE):
        dst[0, t] = F32(0.0)
    for j in range(src.shape[1]):
        for t in range(TILE):
            dst[j + 1, t] = dst[j, t] + src[b0 + t if t < m else b0, j]


@numba.njit(inline="always", **_JIT)
def _reset_scan(best: np.ndarray, chosen: np.ndarray) -> None:
    """A tile's scan state: best [2, TILE] (the score, the scale), chosen [3, TILE] (i1, i2, k; k -1: none)."""
    for t in range(TILE):
        best[0, t], best[1, t] = -_FLT_MAX, F32(0.0)
        chosen[0, t], chosen[1, t], chosen[2, t] = 0, 0, -1


@numba.njit(inline="always", **_JIT)  # called per candidate and lane: no call overhead
def _offer(qx: np.float32, q2: np.float32, t: int, i1: int, i2: int, k: int, best: np.ndarray,
           chosen: np.ndarray) -> None:  # fmt: skip
    """llama.cpp's running choice for one candidate of lane t: it wins when Σwq² > 0 and (Σwqx)² > best·Σwq²
    (then scale = Σwqx/Σwq², best = scale·Σwqx; the first of equals stays)."""
    ok = q2 > F32(0.0) and qx * qx > best[0, t] * q2
    ratio = qx / (q2 if ok else F32(1.0))
    best[0, t] = ratio * qx if ok else best[0, t]
    best[1, t] = ratio if ok else best[1, t]
    chosen[0, t] = i1 if ok else chosen[0, t]
    chosen[1, t] = i2 if ok else chosen[1, t]
    chosen[2, t] = k if ok else chosen[2, t]


@numba.njit(inline="always", **_JIT)
def _store_scan(best: np.ndarray, chosen: np.ndarray, b0: int, m: int, chosen_out: np.ndarray,
                scale_out: np.ndarray) -> None:  # fmt: skip
    for t in range(m):
        for c in range(3):
            chosen_out[b0 + t, c] = chosen[c, t]
        scale_out[b0 + t] = best[1, t]


@numba.njit(**_JIT)
def iq1_s_splits(ws: np.ndarray, wxs: np.ndarray, values: np.ndarray, chosen_out: np.ndarray,
                 scale_out: np.ndarray) -> None:  # fmt: skip
    """IQ1_S's split scan (quantize_row_iq1_s_impl): ws/wxs [S, n] a sub-block's weights and weight·x in
    sorted order; every split i1 <= i2 of that order into levels 0, 1, 2, with `values[k]` (k 0: the
    +1/8 shift, 1: -1/8) in llama.cpp's order. Out: the winning (i1, i2, k) [S, 3] (k -1: none won), its scale."""
    blocks, n = ws.shape
    sx, sw = np.empty((n + 1, TILE), F32), np.empty((n + 1, TILE), F32)
    best, chosen = np.empty((2, TILE), F32), np.empty((3, TILE), np.int64)
    for b0 in range(0, blocks, TILE):
        m = min(TILE, blocks - b0)
        _load_prefix(wxs, sx, b0, m)
        _load_prefix(ws, sw, b0, m)
        _reset_scan(best, chosen)
        for i1 in range(n + 1):
            for i2 in range(i1, n + 1):
                for k in range(2):
                    v0, v1, v2 = values[k, 0], values[k, 1], values[k, 2]
                    for t in range(TILE):
                        qx = (sx[i1, t] - sx[0, t]) * v0 + (sx[i2, t] - sx[i1, t]) * v1 + (sx[n, t] - sx[i2, t]) * v2
                        q2 = ((sw[i1, t] - sw[0, t]) * v0 * v0 + (sw[i2, t] - sw[i1, t]) * v1 * v1
                              + (sw[n, t] - sw[i2, t]) * v2 * v2)  # fmt: skip
                        _offer(qx, q2, t, i1, i2, k, best, chosen)
        _store_scan(best, chosen, b0, m, chosen_out, scale_out)


@numba.njit(**_JIT)
def iq1_m_splits(ws: np.ndarray, wxs: np.ndarray, second: np.ndarray, consts: np.ndarray, chosen_out: np.ndarray,
                 scale_out: np.ndarray) -> None:  # fmt: skip
    """IQ1_M's split scan (quantize_row_iq1_m_impl): as iq1_s_splits with one shift per half (k = 2·first
    half's + second's, 1 meaning -1/8), from prefix sums kept per half (`second[b, j]`: sorted position
    j holds a value of the second half). consts: p2, m2, cp1, cp2, cm1, cm2 (iq1.py's UP[2], DOWN[2], SQUARE_STEPS)."""
    blocks, n = ws.shape
    zero = F32(0.0)
    p2, m2, cp1, cp2, cm1, cm2 = consts[0], consts[1], consts[2], consts[3], consts[4], consts[5]
    px, pw = np.empty((2, n + 1, TILE), F32), np.empty((2, n + 1, TILE), F32)
    fx, f2 = np.empty((2, 2, TILE), F32), np.empty((2, 2, TILE), F32)  # [shift, half, lane]
    best, chosen = np.empty((2, TILE), F32), np.empty((3, TILE), np.int64)
    for b0 in range(0, blocks, TILE):
        m = min(TILE, blocks - b0)
        for t in range(TILE):
            for h in range(2):
                px[h, 0, t] = zero
                pw[h, 0, t] = zero
        for j in range(n):
            for t in range(TILE):
                b = b0 + t if t < m else b0
                mine = 1 if second[b, j] else 0
                for h in range(2):
                    take = h == mine
                    px[h, j + 1, t] = px[h, j, t] + wxs[b, j] if take else px[h, j, t]
                    pw[h, j + 1, t] = pw[h, j, t] + ws[b, j] if take else pw[h, j, t]
        _reset_scan(best, chosen)
        for i1 in range(n + 1):
            for i2 in range(i1, n + 1):
                for t in range(TILE):
                    for h in range(2):
                        s = px[h, i1, t] + px[h, i2, t]
                        tx, tw = px[h, n, t], pw[h, n, t]
                        fx[0, h, t] = tx * p2 - s
                        fx[1, h, t] = tx * m2 - s
                        f2[0, h, t] = tw * p2 * p2 + pw[h, i1, t] * cp1 + pw[h, i2, t] * cp2
                        f2[1, h, t] = tw * m2 * m2 + pw[h, i1, t] * cm1 + pw[h, i2, t] * cm2
                for k in range(4):
                    first, last = k >> 1, k & 1
                    for t in range(TILE):
                        qx = fx[first, 0, t] + fx[last, 1, t]
                        q2 = f2[first, 0, t] + f2[last, 1, t]
                        _offer(qx, q2, t, i1, i2, k, best, chosen)
        _store_scan(best, chosen, b0, m, chosen_out, scale_out)
