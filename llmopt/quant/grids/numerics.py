"""Float32 arithmetic as ggml's C reference quantizers do it, so that our codes match theirs bit for bit.

ggml's reference quantizers run plain float32 C (no FMA, no reassociation): every product and
quotient is rounded to float32, every accumulator adds its terms in index order, `nearest_int` rounds
half to even (the 1.5·2^23 trick) and fp16 conversion rounds to nearest even. The searches themselves
are compiled (`compiled.py`); these are the torch steps the grids take around them, on tensors laid
out element-major, `[n, blocks]`, so that a C loop over the n elements of a block becomes n
vectorized steps over all blocks at once.
"""

from __future__ import annotations

import numpy as np
import torch

GROUP_MAX_EPS = 1e-15  # ggml's threshold under which a group counts as all zeros


def c_float(value: float) -> float:
    """A Python float holding exactly the float32 value C would compute for `value`."""
    return float(np.float32(value))


def c_step(base: float, delta: float, step: int) -> float:
    """C's float32 `base + delta*step` (as in `rmin + rdelta*is`), rounded like the C expression."""
    return c_float(np.float32(base) + np.float32(delta) * np.float32(step))


def nearest_int(v: torch.Tensor) -> torch.Tensor:
    """ggml's nearest_int for |v| <= 2^22: round half to even (kept as float32 for further float math)."""
    return torch.round(v)


def nearest_int_exact(v: torch.Tensor) -> torch.Tensor:
    """nearest_int bit for bit, including its wrap-around outside |v| <= 2^22 (a ratio of two sums can
    get there) and its -2^22 for ±inf and 0 for NaN (a block of float32 denormals, whose inverse scale
    overflows); use where the argument is not bounded by the level range."""
    bits = (v + 12582912.0).view(torch.int32)
    return ((bits & 0x007FFFFF) - 0x00400000).to(torch.float32)


def seq_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over dim 0 in index order with a float32 accumulator, as a C `for` loop does (one in-place
    add per element over all blocks: for `t` contiguous each row it adds is contiguous too)."""
    rows = t.unbind(0)
    acc = rows[0].clone()
    for row in rows[1:]:
        acc.add_(row)
    return acc


def fp16(v: torch.Tensor) -> torch.Tensor:
    """GGML_FP32_TO_FP16 then back to float32: the value the file stores."""
    return v.to(torch.float16).to(torch.float32)


def first_absmax(x: torch.Tensor) -> torch.Tensor:
    """Per block (dim 0 = elements), the signed value of largest magnitude, first one on ties, +0 for
    an all-zero block (C: `max = 0; if (fabsf(x) > amax) ...`). The largest and smallest values
    decide it unless both ±max occur; only those blocks are searched in order."""
    hi, lo = x.amax(dim=0), x.amin(dim=0)
    value = torch.where(hi > -lo, hi, lo)
    tie = hi == -lo
    if bool(tie.any()):
        idx = tie.nonzero()[:, 0]
        sub = x[:, idx]
        value[idx] = sub.gather(0, sub.abs().argmax(dim=0, keepdim=True))[0]
    return torch.where(value != 0, value, torch.zeros_like(value))


def positive_max(v: torch.Tensor, dim: int) -> torch.Tensor:
    """C's `m = 0; if (v > m) m = v`: the largest value, or +0 when none is positive."""
    m = v.amax(dim=dim)
    return torch.where(m > 0, m, torch.zeros_like(m))


def c_sqrt(v: torch.Tensor) -> torch.Tensor:
    """sqrtf, correctly rounded. (torch's vectorized float32 sqrt is off by one ulp for ~20% of inputs;
    the float64 root rounded to float32 is the exact float32 root.)"""
    return torch.sqrt(v.to(torch.float64)).to(torch.float32)


def rdiv(num: float, den: torch.Tensor) -> torch.Tensor:
    """C's float `num / den` for a constant numerator. (`num / tensor` in torch multiplies by the
    reciprocal, rounding twice; dividing a 0-d tensor rounds once, as C does.)"""
    return torch.tensor(num, dtype=torch.float32) / den


def inverse_or_zero(d: torch.Tensor) -> torch.Tensor:
    """C's `d ? 1.0f/d : 0.0f` (one rounding, as `rdiv`)."""
    return torch.where(d == 0, torch.zeros_like(d), rdiv(1.0, torch.where(d == 0, torch.ones_like(d), d)))


def roundf(v: torch.Tensor) -> torch.Tensor:
    """C's roundf (half away from zero), computed exactly as gguf's np_roundf does."""
    a = v.abs()
    floored = torch.floor(a)
    return floored.add_(torch.floor(a.sub_(floored).mul_(2))).copysign_(v)


def safe_div(num: torch.Tensor | float, den: torch.Tensor) -> torch.Tensor:
    """num / den where den != 0 (callers mask the other lanes), without inf/nan warnings leaking."""
    return num / torch.where(den == 0, torch.ones_like(den), den)


def blocks_major(x: torch.Tensor, n: int) -> torch.Tensor:
    """[rows, cols] -> [n, rows*cols/n]: element j of every consecutive n-block, contiguous per j."""
    return x.reshape(-1, n).t().contiguous()


def uint8_wrap(v: torch.Tensor) -> torch.Tensor:
    """C's `(uint8_t) int`: wrap modulo 256 (matters only for the rare negative sub-scale)."""
    return torch.remainder(v, 256)
