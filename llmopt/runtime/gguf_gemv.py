"""Batch-1 decode products of the GGUF weights kept quantized (gguf_linear.py), compiled by inductor.

A decode step multiplies each weight by one activation vector. Rebuilding float32 tiles of W and
calling a dense product (the path every other input takes) reads and writes 4 bytes a weight; here
inductor turns the product written over the stored fields, sum over groups g and inputs k of
(q[o, g, k] A[o, g] - B[o, g]) x[g, k], into one C++ loop that reads the packed bytes and never
builds W. The fields hold LANES rows side by side in their last axis (gguf_linear.interleave), so the
loop keeps one float32 vector of partial sums across those rows and adds each group's Σ q x into it,
scaled, with no horizontal sum; each function's shapes name that axis L and the blocks of rows B.
Measured on this project's 2-core CPU, from RAM, per type and shape: benchmarks/decode_products.py and
docs/generate.md.

The sums run in another order than the dequantized product's: results agree to float32 rounding
(about 1e-7 of the largest output), not bit for bit. Each weight shape compiles once (seconds, cached
on disk by inductor; a model has a handful of shapes), handed to inductor directly: through
`torch.compile`, dynamo's guards and call path cost more than a small product's arithmetic. Each
module binds its product to its fields on its first decode step (`bind_product`). Where
inductor cannot compile (no C++ compiler), the first failure is logged and every later product
takes the tile path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from llmopt.quant.grids.codebooks import IQ4_VALUES

log = logging.getLogger(__name__)
_compiled: dict[tuple, Callable[..., list[torch.Tensor]]] = {}
_failed = False


def fifth_bits(high: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Q5's fifth bits (0 or 1, input order) from its 32-bit qh words, one per group, held in a size-1 axis
    `dim` of `high`; the bits take that axis: bit k is input k's. (Shifting one word compiles to a vector
    loop; shifting its four bytes did not: 3x slower.)"""
    shape = [1] * high.dim()
    shape[dim] = 32
    return (high >> torch.arange(32, dtype=torch.int32, device=high.device).reshape(shape)) & 1


def bit_field(q: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """Field k of `bits` bits of each byte of `q`, as float: a mask, then an exact power-of-two scale (AVX-512
    has no byte shift; gguf_codes.py, group_int.py)."""
    mask = ((1 << bits) - 1) << bits * k
    return (q & mask).float() * 2.0 ** (-bits * k)


def _inputs(x: torch.Tensor, *shape: int) -> torch.Tensor:
    """The input vector as `shape` (its grouping), with a trailing axis that broadcasts over the lanes."""
    return x.reshape(*shape, 1)


def _lanes(y: torch.Tensor) -> torch.Tensor:
    """[blocks, lanes] outputs -> the output vector, row order (padding rows included)."""
    return y.reshape(-1)


def nibble_gemv(x: torch.Tensor, codes: torch.Tensor, high: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor,
                a_mult: torch.Tensor | int, b_mult: torch.Tensor | int, per: int) -> torch.Tensor:  # fmt: skip
    """x [in] times NibbleLinear's W: codes [B, G, 16, L] (inputs k and k + 16 of a group in one byte),
    Q5's 32-bit qh words `high` [B, G, 1, L] (fifth_bits), a/b [B, G / per, L] and their multipliers
    (see NibbleLinear). Each group's Σ q x first, then scaled, and the offsets times each group's Σ x."""
    groups = codes.shape[1]
    xg = _inputs(x, groups, 2, 16)
    lo, hi16 = (codes & 15).float(), (codes & 240).float()  # hi16: the high nibble times 16 (no byte shift)
    if high is not None:
        fifth = fifth_bits(high, dim=-2).float() * 16  # [B, G, 32, L]
        lo, hi16 = lo + fifth[:, :, :16], hi16 + fifth[:, :, 16:] * 16
    inner = (lo * xg[:, 0] + hi16 * (xg[:, 1] * 0.0625)).sum(2)  # [B, G, L]
    scale = a.float().repeat_interleave(per, 1) * a_mult
    offset = b.float().repeat_interleave(per, 1) * b_mult
    return _lanes((inner * scale - offset * xg.sum((1, 2))).sum(1))


def int8_gemv(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [in] times Q8_0's W: int8 codes [B, G, 32, L], float16 scales [B, G, 1, L]. Each group's Σ q·x
    first, then scaled."""
    inner = (codes.float() * _inputs(x, codes.shape[1], 32)).sum(2, keepdim=True)  # [B, G, 1, L]
    return _lanes((inner * scales.float()).sum((1, 2)))


def _pair_shifts(qh: torch.Tensor) -> torch.Tensor:
    """0, 2, 4, 6 as a column: the shifts of a byte's four bit pairs (Q6_K's qh, Q2_K/Q3_K's codes). (Made
    in the function, not held as a module constant: the products are traced with fake tensors, _compile.)"""
    return torch.arange(0, 8, 2, dtype=torch.uint8, device=qh.device).reshape(4, 1)


def q6_k_codes(ql: torch.Tensor, qh: torch.Tensor) -> torch.Tensor:
    """Q6_K's six-bit codes [out, blocks, 2, 4, 32] in input order (half of the block, quarter of the
    half, input) from its low nibbles ql [out, blocks, 128] and high bit pairs qh [out, blocks, 64]: a
    half's 64 ql bytes hold its quarters 0, 1 in their low nibbles and 2, 3 in their high ones, its 32
    qh bytes quarter p in bits 2p, 2p + 1 (ggml's dequantize_row_q6_K)."""
    out, blocks = ql.shape[:2]
    quarters = ql.reshape(out, blocks, 2, 2, 32)
    lo = torch.cat([quarters & 15, quarters >> 4], dim=3)
    hi = (qh.reshape(out, blocks, 2, 1, 32) >> _pair_shifts(qh)) & 3
    return lo | (hi << 4)


def q6_k_gemv(x: torch.Tensor, ql: torch.Tensor, qh: torch.Tensor, scales: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """x [in] times Q6_K's W = d sc (q - 32): ql [B, blocks, 128, L], qh [B, blocks, 64, L] (layout:
    q6_k_codes), int8 scales [B, blocks, 16, L] per 16 inputs, float16 d [B, blocks, L]. One sum per
    quarter (0-1 from the ql bytes' low nibbles, 2-3 from their high ones), rather than one over the codes
    q6_k_codes concatenates: inductor then reads each ql byte into two without building the codes."""
    n, blocks, _, lanes = ql.shape
    low = ql.reshape(n, blocks, 2, 2, 32, lanes)  # [half, quarter of the pair, input]
    high = qh.reshape(n, blocks, 2, 32, lanes)  # [half, input]: quarter t's bits at 2t
    scale = (d.float()[:, :, None] * scales.float()).reshape(n, blocks, 2, 2, 2, 2, lanes)  # [half, pair, quarter, 16s]
    xs = _inputs(x, blocks, 2, 2, 2, 2, 16)
    sums = xs.sum(-2)  # [blocks, half, pair, quarter, 16s, 1]
    y = 0
    for p in range(2):  # masks, then exact power-of-two scales: AVX-512 has no byte shift
        nibbles = (low & (15 << 4 * p)).float() * 0.0625**p
        for j in range(2):
            t = 2 * p + j
            q = nibbles[:, :, :, j] + (high & (3 << 2 * t)).float() * (16 * 0.25**t)  # [B, blocks, half, input, L]
            inner = (q.reshape(n, blocks, 2, 2, 16, lanes) * xs[:, :, p, j]).sum(-2) - 32 * sums[:, :, p, j]
            y = y + (inner * scale[:, :, :, p, j]).sum((1, 2, 3))
    return _lanes(y)


def k_low_codes(qs: torch.Tensor, hmask: torch.Tensor | None) -> torch.Tensor:
    """Q2_K's codes (0..3) or Q3_K's (-4..3) [out, blocks, 16, 16] in input order (16 groups of 16) from
    the two-bit codes qs [out, blocks, 64] and Q3_K's high bits hmask [out, blocks, 32]: input
    128 h + 32 s + l sits in bits 2s of qs byte 32 h + l and bit 4 h + s of hmask byte l; Q3_K's code is
    low - 4 where that bit is 0 (ggml's dequantize_row_q3_K)."""
    out, blocks = qs.shape[:2]
    q = (qs.reshape(out, blocks, 2, 1, 32) >> _pair_shifts(qs)) & 3  # [half, shift, input]
    if hmask is not None:
        bits = torch.arange(8, dtype=torch.uint8, device=qs.device).reshape(2, 4, 1)
        high = (hmask.reshape(out, blocks, 1, 1, 32) >> bits) & 1
        q = (q | (high << 2)).to(torch.int8) - 4
    return q.reshape(out, blocks, 16, 16)


def k_low_gemv(x: torch.Tensor, qs: torch.Tensor, hmask: torch.Tensor | None, d: torch.Tensor, scales: torch.Tensor,
               dmin: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    """x [in] times Q2_K's W = d (sc & 15) q - dmin (sc >> 4), or Q3_K's W = d sc q (scales int8, already
    less 32; dmin None), per 16 inputs: qs [B, blocks, 64, L], hmask [B, blocks, 32, L] (layout:
    k_low_codes), d and dmin [B, blocks, L], scales [B, blocks, 16, L]. One sum per (half, shift), each
    shifting by a constant, rather than the codes k_low_codes builds with broadcast shifts (4096x4096
    from RAM, 2 threads: Q3_K 2.4 ms against 42, Q2_K 1.5 against 13)."""
    n, blocks, _, lanes = qs.shape
    codes = qs.reshape(n, blocks, 2, 2, 16, lanes)  # [half, byte l // 16, l % 16]
    high = None if hmask is None else hmask.reshape(n, blocks, 2, 16, lanes)
    xs = _inputs(x, blocks, 2, 4, 2, 16)  # [half, shift, l // 16, l % 16]
    sc = scales.float() if dmin is None else (scales & 15).float()
    scale = (sc * d.float()[:, :, None]).reshape(n, blocks, 2, 4, 2, lanes)
    y = 0
    for h in range(2):
        for s in range(4):  # (a mask, then an exact power-of-two scale: AVX-512 has no byte shift)
            q = (codes[:, :, h] & (3 << 2 * s)).float() * 0.25**s
            if high is not None:
                q = q + (high & (1 << 4 * h + s)).float() * 2.0 ** (2 - 4 * h - s) - 4
            y = y + ((q * xs[:, h, s]).sum(-2) * scale[:, :, h, s]).sum((1, 2))
    if dmin is not None:
        mins = (scales >> 4).float() * dmin.float()[:, :, None]  # [B, blocks, 16, L]
        y = y - (mins * _inputs(x, blocks, 16, 16).sum(-2)).sum((1, 2))
    return _lanes(y)


def level_polynomial(levels: tuple[int, ...], degree: int = 4) -> tuple[float, ...]:
    """Coefficients (highest power first) of a polynomial p with round(p(i)) = levels[i] for every index i of
    sorted levels (IQ4's 16; FP4's, degree 5): levels by arithmetic, which inductor vectorizes, instead of a
    table lookup, which it does not (IQ4 4096x4096 from RAM, 2 threads: 17.7 ms looked up). Checked here:
    each level within 0.49 before rounding (IQ4 at degree 4: 0.48)."""
    coefficients = np.polyfit(np.arange(len(levels)), np.array(levels, dtype=np.float64), degree)
    at = np.polyval(coefficients.astype(np.float32), np.arange(len(levels), dtype=np.float32))
    if not np.array_equal(np.round(at), levels) or np.abs(at - levels).max() > 0.49:
        raise AssertionError(f"no polynomial of degree {degree} rounds to the levels {levels}")
    return tuple(float(c) for c in coefficients.astype(np.float32))


IQ4_POLYNOMIAL = level_polynomial(IQ4_VALUES)


def polynomial_levels(codes: torch.Tensor, coefficients: tuple[float, ...], unit: int = 1) -> torch.Tensor:
    """The level (level_polynomial's) of each index, as float32, from codes that are `unit` (a power of two)
    times the index: a high nibble masked in place, unit 16. Horner's steps then run scaled by powers of two,
    so every rounding is the unscaled one's."""
    q = codes.float()
    degree = len(coefficients) - 1
    y = torch.full_like(q, coefficients[0] / unit**degree)
    for k, c in enumerate(coefficients[1:], start=1):
        y = y * q + c / unit ** (degree - k)
    return torch.round(y)


def iq4_levels(codes: torch.Tensor, unit: int = 1) -> torch.Tensor:
    """llama.cpp's IQ4 level (codebooks.IQ4_VALUES) of each 4-bit index (polynomial_levels)."""
    return polynomial_levels(codes, IQ4_POLYNOMIAL, unit)


def iq4_gemv(x: torch.Tensor, codes: torch.Tensor, a: torch.Tensor, a_mult: torch.Tensor | int,
             per: int) -> torch.Tensor:  # fmt: skip
    """x [in] times IQ4_NL/IQ4_XS's W = v[q] a a_mult per 32 inputs: codes [B, G, 16, L] as Q4_0's nibbles,
    v llama.cpp's 16 levels (iq4_levels), a float16 [B, G / per, L]."""
    xg = _inputs(x, codes.shape[1], 2, 16)
    inner = (iq4_levels(codes & 15) * xg[:, 0] + iq4_levels(codes & 240, 16) * xg[:, 1]).sum(2)  # [B, G, L]
    return _lanes((inner * (a.float().repeat_interleave(per, 1) * a_mult)).sum(1))


def f16_gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [in] times a float16 W [B, in, L], converted to float32 as it is read."""
    return _lanes((weight.float() * _inputs(x, weight.shape[1])).sum(1))


def compiled_products_work() -> bool:
    """False once a compiled product failed in this process (every product then takes the tile path)."""
    return not _failed


def _tensors(args: tuple) -> list[torch.Tensor]:
    """The tensor arguments, in order: what a compiled product is called with."""
    return [a for a in args if isinstance(a, torch.Tensor)]


def _signature(fn: Callable, args: tuple) -> tuple:
    """What a compiled product is specialized to: the function, each tensor's shape, strides and dtype,
    every other argument's value."""
    return (fn, *((tuple(a.shape), a.stride(), a.dtype) if isinstance(a, torch.Tensor) else a for a in args))


def _compile(fn: Callable[..., torch.Tensor], args: tuple) -> Callable[..., list[torch.Tensor]]:
    """fn over these arguments' shapes, traced with fake tensors (no eager run: a 7B's products would
    build GBs of float intermediates) and compiled by inductor, called with the tensor arguments only."""
    import torch._inductor  # (imported on first use: it takes a second)
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    def over_tensors(*tensors: torch.Tensor) -> tuple[torch.Tensor]:
        given = iter(tensors)
        return (fn(*(next(given) if isinstance(a, torch.Tensor) else a for a in args)),)

    tensors = _tensors(args)
    graph = make_fx(over_tensors, tracing_mode="fake")(*tensors)
    # a tracing context whose fake mode has a shape environment: without one, inductor's FX graph cache
    # steps aside ("No shape env") and every process generates and builds each product again
    fake_mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
    with torch._guards.tracing(torch._guards.TracingContext(fake_mode)):
        return torch._inductor.compile(graph, tensors)


def bind_product(fn: Callable[..., torch.Tensor], x: torch.Tensor,
                 fields: tuple) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """`x -> fn(x, *fields)` compiled for these shapes (once per weight shape: SmolLM2's Q4_K_M file has 8),
    bound to these fields, so a decode step's call pays for no lookup; None where it cannot run compiled
    (the caller takes its tile path). Run once here, so a failure at the first call falls back too."""
    global _failed
    if _failed:
        return None
    args = (x, *fields)
    tensors = _tensors(fields)
    try:
        key = _signature(fn, args)
        compiled = _compiled.get(key)
        if compiled is None:
            compiled = _compiled[key] = _compile(fn, args)
        compiled(x, *tensors)
    except Exception as e:  # noqa: BLE001 - inductor's failures have no common type; the tile path still works
        _failed = True
        log.warning("compiled decode products unavailable (%s: %s); using the slower tile path",
                    type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
        return None
    return lambda x: compiled(x, *tensors)[0]
