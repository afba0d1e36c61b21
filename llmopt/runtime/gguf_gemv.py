"""Batch-1 decode products of the GGUF weights kept quantized (gguf_linear.py), compiled by inductor.

A decode step multiplies each weight by one activation vector. Rebuilding float32 tiles of W and
calling a dense product (the path every other input takes) reads and writes 4 bytes a weight; here
inductor turns the product written over the stored fields, sum over groups g and inputs k of
(q[o, g, k] A[o, g] - B[o, g]) x[g, k], into one C++ loop that reads the packed bytes and never
builds W. Measured on this project's 2-core CPU (fp32 W in RAM for comparison): Q4_0 4096x4096
1469 us against 3988, Q4_K 11008x4096 5416 us against 10997; SmolLM2's decode from a Q4_0 file
goes from 7.96 to 22.59 tok/s (docs/generate.md).

The sums run in another order than the dequantized product's: results agree to float32 rounding
(about 1e-7 of the largest output), not bit for bit. Each weight shape compiles once (seconds, cached
on disk by inductor; a model has a handful of shapes), handed to inductor directly: through
`torch.compile`, dynamo's guards and call path cost more than a small product's arithmetic. Where
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


def fifth_bits(high: torch.Tensor) -> torch.Tensor:
    """Q5's fifth bits [..., G, 32] (0 or 1, input order) from its 32-bit qh words [..., G, 1]: bit k is
    input k's. (Shifting one word compiles to a vector loop; shifting its four bytes did not: 3x slower.)"""
    return (high >> torch.arange(32, dtype=torch.int32, device=high.device)) & 1


def nibble_gemv(x: torch.Tensor, codes: torch.Tensor, high: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor,
                a_mult: torch.Tensor | int, b_mult: torch.Tensor | int, per: int) -> torch.Tensor:  # fmt: skip
    """x [in] times NibbleLinear's W: codes [out, G, 16] (inputs k and k + 16 of a group in one byte),
    Q5's 32-bit qh words `high` [out, G, 1] (fifth_bits), a/b [out, G / per] and their multipliers
    (see NibbleLinear)."""
    xg = x.reshape(codes.shape[1], 32)
    lo, hi = (codes & 15).float(), (codes >> 4).float()
    if high is not None:
        fifth = fifth_bits(high).float() * 16  # [out, G, 32]
        lo, hi = lo + fifth[..., :16], hi + fifth[..., 16:]
    scale = (a.float().repeat_interleave(per, 1) * a_mult)[..., None]
    offset = (b.float().repeat_interleave(per, 1) * b_mult)[..., None]
    return ((lo * scale - offset) * xg[:, :16] + (hi * scale - offset) * xg[:, 16:]).sum((-1, -2))


def int8_gemv(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [in] times Q8_0's W: int8 codes [out, G, 32], float16 scales [out, G, 1]. Each group's Σ q·x
    first, then scaled: inductor's loop then keeps its sums in independent registers (a 3072x576
    product from RAM, 2 threads: 80 us against 148 for Σ q·s·x over the row; the nibble and Q6_K
    products measured slower written so)."""
    per_group = (codes.float() * x.reshape(codes.shape[1], 32)).sum(-1)  # [out, G]
    return (per_group * scales.float()[..., 0]).sum(-1)


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
    """x [in] times Q6_K's W = d sc (q - 32): scales int8 [out, blocks, 16] per 16 inputs, d float16 [out, blocks].
    Two sums, quarters 0-1 (the ql bytes' low nibbles) and 2-3 (high nibbles), rather than one over the
    codes q6_k_codes concatenates: inductor then reads each ql byte into both without building the
    codes (576x1536 from RAM, 2 threads: 75 us against 126)."""
    out, blocks = ql.shape[:2]
    low = ql.reshape(out, blocks, 2, 2, 32)  # [half, quarter of the pair, input]
    high = (qh.reshape(out, blocks, 2, 1, 32) >> _pair_shifts(qh)) & 3  # [half, quarter, input]
    scale = (d.float()[..., None] * scales.float()).reshape(out, blocks, 2, 2, 2, 2, 1)  # [half, pair, quarter, 16s]
    xs = x.reshape(blocks, 2, 2, 2, 2, 16)
    pairs = ((low & 15) | (high[:, :, :, :2] << 4), (low >> 4) | (high[:, :, :, 2:] << 4))
    return sum(((q.float() - 32).reshape(out, blocks, 2, 2, 2, 16) * scale[:, :, :, p] * xs[:, :, p])
               .sum((-1, -2, -3, -4, -5)) for p, q in enumerate(pairs))  # fmt: skip


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
    less 32; dmin None), per 16 inputs (layout: k_low_codes). One sum per (half, shift), each shifting by
    a constant, rather than the codes k_low_codes builds with broadcast shifts: 4096x4096 from RAM,
    2 threads, Q3_K 2.4 ms against 42, Q2_K 1.5 against 13 (benchmarks/decode_products.py)."""
    out, blocks = qs.shape[:2]
    codes = qs.reshape(out, blocks, 2, 2, 16)  # [half, byte l // 16, l % 16]
    high = None if hmask is None else hmask.reshape(out, blocks, 2, 16)
    xs = x.reshape(blocks, 2, 4, 2, 16)  # [half, shift, l // 16, l % 16]
    sc = scales.float() if dmin is None else (scales & 15).float()
    scale = (sc * d.float()[..., None]).reshape(out, blocks, 2, 4, 2, 1)
    y = 0
    for h in range(2):
        for s in range(4):
            q = ((codes[:, :, h] >> (2 * s)) & 3).float()
            if high is not None:
                q = q + 4 * ((high >> (4 * h + s)) & 1).float() - 4
            y = y + (q * scale[:, :, h, s] * xs[:, h, s]).sum((-1, -2, -3))
    if dmin is not None:
        y = y - ((scales >> 4).float() * dmin.float()[..., None] * x.reshape(blocks, 16, 16).sum(-1)).sum((-1, -2))
    return y


def _level_polynomial(levels: tuple[int, ...], degree: int = 4) -> tuple[float, ...]:
    """Coefficients (highest power first) of a polynomial p with round(p(i)) = levels[i] for every index i:
    IQ4's 16 levels by arithmetic, which inductor vectorizes, instead of a table lookup, which it does not
    (4096x4096 from RAM, 2 threads: 17.7 ms looked up). Degree 4 misses each level by at most 0.48."""
    coefficients = np.polyfit(np.arange(len(levels)), np.array(levels, dtype=np.float64), degree)
    at = np.polyval(coefficients.astype(np.float32), np.arange(len(levels), dtype=np.float32))
    if not np.array_equal(np.round(at), levels) or np.abs(at - levels).max() > 0.49:
        raise AssertionError("the IQ4 level polynomial does not round to the levels")
    return tuple(float(c) for c in coefficients.astype(np.float32))


IQ4_POLYNOMIAL = _level_polynomial(IQ4_VALUES)


def iq4_levels(codes: torch.Tensor) -> torch.Tensor:
    """llama.cpp's IQ4 level (codebooks.IQ4_VALUES) of each 4-bit index, as float32."""
    q = codes.float()
    y = torch.full_like(q, IQ4_POLYNOMIAL[0])
    for c in IQ4_POLYNOMIAL[1:]:
        y = y * q + c
    return torch.round(y)


def iq4_gemv(x: torch.Tensor, codes: torch.Tensor, a: torch.Tensor, a_mult: torch.Tensor | int,
             per: int) -> torch.Tensor:  # fmt: skip
    """x [in] times IQ4_NL/IQ4_XS's W = v[q] a a_mult per 32 inputs: codes [out, G, 16] as Q4_0's nibbles,
    v llama.cpp's 16 levels (iq4_levels), a float16 [out, G / per]."""
    xg = x.reshape(codes.shape[1], 32)
    lo, hi = iq4_levels(codes & 15), iq4_levels(codes >> 4)
    per_group = (lo * xg[:, :16] + hi * xg[:, 16:]).sum(-1)  # [out, G]
    return (per_group * (a.float().repeat_interleave(per, 1) * a_mult)).sum(-1)


def f16_gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [in] times a float16 W [out, in], converted to float32 as it is read."""
    return (weight.float() * x).sum(-1)


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
    from torch.fx.experimental.proxy_tensor import make_fx

    def over_tensors(*tensors: torch.Tensor) -> tuple[torch.Tensor]:
        given = iter(tensors)
        return (fn(*(next(given) if isinstance(a, torch.Tensor) else a for a in args)),)

    tensors = _tensors(args)
    return torch._inductor.compile(make_fx(over_tensors, tracing_mode="fake")(*tensors), tensors)


def decode_product(fn: Callable[..., torch.Tensor], x: torch.Tensor, *fields: torch.Tensor | int | None) -> torch.Tensor | None:
    """`fn(x, *fields)` compiled for these shapes (once per weight shape: SmolLM2's Q4_K_M file has 8);
    None where it cannot run compiled (the caller takes its tile path)."""
    global _failed
    args = (x, *fields)
    if torch.compiler.is_compiling():
        return fn(*args)  # inside a compiled decode step (generate --compile): part of its graph
    if _failed:
        return None
    try:
        key = _signature(fn, args)
        compiled = _compiled.get(key)
        if compiled is None:
            compiled = _compiled[key] = _compile(fn, args)
        return compiled(*_tensors(args))[0]
    except Exception as e:  # noqa: BLE001 - inductor's failures have no common type; the tile path still works
        _failed = True
        log.warning("compiled decode products unavailable (%s: %s); using the slower tile path",
                    type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
        return None
