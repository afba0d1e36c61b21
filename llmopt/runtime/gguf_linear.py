"""GGUF weights kept in their quantized form in memory (CPU or CUDA), instead of dequantized to the compute dtype.

Each 2-D weight of a quantized (or F16) type takes one of these paths (the registry in linear.py chooses):

* Q4_0, Q4_1, Q4_K in a bfloat16 model -> `PackedInt4Linear` (torch's int4 kernel). All three are 4-bit
  codes with one scale and one offset per 32 inputs: Q4_0 W = (q - 8) d, Q4_1 W = d q + m, Q4_K
  W = (d sc) q - dmin m. The kernel holds its scale/offset pairs in bfloat16, which rounds d (float16,
  11-bit mantissa) and d sc (up to 17 bits) to 8 bits: close, not exact (see docs/generate.md).
* the same types and Q5_0/Q5_1/Q5_K, otherwise -> `NibbleLinear`: the nibbles (and fifth bits) and the
  blocks' own scale fields, W rebuilt one tile of rows at a time with gguf's arithmetic (exact).
* Q8_0 -> `Int8GroupLinear`: int8 codes and float16 scales, rebuilt per tile (exact).
* Q6_K -> `Q6KLinear`: the block's fields apart, rebuilt per tile (exact).
* Q2_K, Q3_K -> `KLowLinear`: two-bit codes (+ Q3_K's third bits) and the scale fields (exact).
* F16 -> `F16Linear`: the float16 weight, widened per tile (exact).
* IQ4_NL, IQ4_XS -> `IQ4Linear`: the 4-bit indices and the scale fields, levels looked up (exact).
* IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M -> `gguf_lattice.LatticeLinear`: the file's fields,
  codebook points looked up (exact).
* TQ1_0, TQ2_0, Q1_0, Q2_0, MXFP4, NVFP4 -> `gguf_codes.CodeLinear`: the file's fields (exact).
* any other type (none that llmopt writes) -> `RawGGUFLinear`: the file's block bytes, dequantized by
  `model/dequantize.py` (the reader's one definition) one tile of rows at a time inside forward (exact, slow).

A batch-1 decode step's input to the float paths but RawGGUFLinear (any float dtype) takes a compiled
product over the stored fields instead (gguf_gemv.py, gguf_lattice.py, gguf_codes.py; equal to float32
rounding; per type and shape against a float32 weight: benchmarks/decode_products.py, docs/generate.md).
Embeddings stay quantized the same way (`QuantizedEmbedding`) and dequantize only the looked-up rows. Peak memory is the quantized
weights plus one tile of float rows (TILE_BYTES).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from llmopt.model.dequantize import dequantize
from llmopt.model.ggml_types import GGML_TYPES_BY_ID, GGMLQuantType
from llmopt.model.gguf_file import GGUFSource
from llmopt.quant.grids.codebooks import IQ4_VALUES
from llmopt.runtime.gguf_gemv import (bind_product, f16_gemv, fifth_bits, int8_gemv, iq4_gemv, k_low_codes,
                                      k_low_gemv, nibble_gemv, q6_k_codes, q6_k_gemv)

Q = GGMLQuantType
IQ4_LEVELS = torch.tensor(IQ4_VALUES, dtype=torch.float32)  # IQ4Linear's tiles look the levels up (its `lookup`)
# Float weights rebuilt per tile of rows, about this many bytes: small enough to stay in cache while the
# product reads it, large enough that the rebuild's eager ops and the tiles' products are not many small
# calls. A 7B's 11008x4096 Q4_0 over 256 rows, 2 threads: 230 ms in 1 MB tiles, 187 in 8, 196 in 16,
# dense float32 203; IQ2_XS 771, 403, 387 (benchmarks/prefill_tiles.py, docs/generate.md).
TILE_BYTES = 8 << 20
# Rows a FieldLinear holds side by side (`interleave`): its compiled decode product then sums each
# group down the rows' lanes, one float32 vector of 16 (AVX-512) or two (AVX2) per step, with no
# horizontal sums. Q4_0 3072x576 from RAM, 2 threads: 155 us against 192 row by row (docs/generate.md).
LANES = 16
DENSE_TYPES = (Q.F32, Q.BF16)  # loaded as ordinary float weights


def raw_rows(source: GGUFSource, name: str) -> tuple[GGMLQuantType, torch.Tensor]:
    """The stored type and block bytes [rows, bytes per row] of 2-D tensor `name`, copied out of the
    file's map, rows in HF order (a fused tensor's part sliced, llama.cpp's Q/K permutation undone)."""
    raw, data, shape = source.stored_tensor(name)  # only `name`'s rows of an expert stack or a fused tensor
    blocks = torch.from_numpy(np.array(data).view(np.uint8).reshape(*shape[:-1], -1))
    return raw.tensor_type, source.hf_rows(name, blocks).contiguous()


def dequantize_rows(qtype: GGMLQuantType, blocks: torch.Tensor) -> torch.Tensor:
    """Float32 rows of block bytes [rows, bytes per row] (the reader's dequantizer, numpy: on the CPU), on the
    blocks' device."""
    return torch.from_numpy(dequantize(blocks.cpu().numpy(), qtype)).to(blocks.device)


def _half(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 field at byte `at` of each block [n, size] -> float32 [n]."""
    return blocks[:, at:at + 2].contiguous().view(torch.float16).reshape(-1).float()


def _nibbles(qs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return qs & 0xF, qs >> 4


def _k4_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 bytes -> 8 six-bit sub-block scales and mins [n, 8] (ggml-quants.c get_scale_min_k4)."""
    q = packed.to(torch.int32)
    sc = torch.cat([q[:, 0:4] & 63, (q[:, 8:12] & 0xF) | ((q[:, 0:4] >> 6) << 4)], dim=1)
    m = torch.cat([q[:, 4:8] & 63, (q[:, 8:12] >> 4) | ((q[:, 4:8] >> 6) << 4)], dim=1)
    return sc, m


def _k_fields(data: torch.Tensor, size: int = 144, qs_at: int = 16) -> tuple[torch.Tensor, ...]:
    """Q4_K (or Q5_K: size 176, nibbles at 48) block bytes [out, bytes per row] -> low-nibble codes
    [out, in] in input order, d and dmin [out, in / 256] (float16) and the six-bit sub-block scales and
    mins [out, in / 32]."""
    out = data.shape[0]
    b = data.reshape(-1, size)
    sc, m = _k4_scales_mins(b[:, 4:16])
    lo, hi = _nibbles(b[:, qs_at:qs_at + 128].reshape(-1, 4, 32))  # 64 values per 32 bytes: low nibbles first
    codes = torch.stack([lo, hi], dim=2).reshape(out, -1)
    d, dmin = (b[:, at:at + 2].contiguous().view(torch.float16).reshape(out, -1) for at in (0, 2))
    return codes, d, dmin, sc.reshape(out, -1), m.reshape(out, -1)


def _k5_high_words(data: torch.Tensor) -> torch.Tensor:
    """Q5_K's fifth bits as NibbleLinear's int32 words [out, in / 32, 1] (bit k: input k of the group).
    The block's 32 qh bytes hold sub-block s's bit for input l as bit s of byte l (ggml's u1/u2 masks)."""
    out = data.shape[0]
    qh = data.reshape(-1, 176)[:, 16:48].numpy()  # [blocks, 32]
    bits = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [blocks, sub-block, input]
    words = np.packbits(bits, axis=-1, bitorder="little").view("<u4").astype(np.int32)
    return torch.from_numpy(words).reshape(out, -1, 1)


def int4_parts(qtype: GGMLQuantType, data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0/Q4_1/Q4_K block bytes [out, bytes per row] -> codes [out, in] (0..15) and float32 scales and
    offsets [out, in / 32] with W = (codes - 8) * scale + offset (the int4 kernel's form)."""
    out = data.shape[0]
    if qtype == Q.Q4_K:
        codes, d, dmin, sc, m = _k_fields(data)
        scales = d.float().repeat_interleave(8, dim=1) * sc
        offsets = 8 * scales - dmin.float().repeat_interleave(8, dim=1) * m
    else:
        size = 18 if qtype == Q.Q4_0 else 20
        b = data.reshape(-1, size)
        codes = torch.cat(_nibbles(b[:, size - 16:]), dim=1).reshape(out, -1)
        scales = _half(b, 0)
        offsets = torch.zeros_like(scales) if qtype == Q.Q4_0 else _half(b, 2) + 8 * scales
    return codes, scales.reshape(out, -1), offsets.reshape(out, -1)


def one_row(x: torch.Tensor) -> bool:
    """A batch-1 decode step's input: it takes the compiled product (gguf_gemv.py), in float32."""
    return x.numel() == x.shape[-1]


def with_bias(y: torch.Tensor, bias: torch.Tensor | None, like: torch.Tensor | None = None) -> torch.Tensor:
    """y (+ bias); a compiled product's float32 y [in] reshaped to `like`'s rows and dtype."""
    if like is not None:
        y = y.view(*like.shape[:-1], -1)
        y = y if y.dtype == like.dtype else y.to(like.dtype)
    return y if bias is None else y + bias.to(y.dtype)


def tiled_linear(x: torch.Tensor, out_features: int, in_features: int, rows_of: Callable[[slice], torch.Tensor],
                 bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T (+ b), with W's rows rebuilt by `rows_of` one tile (a slice of rows) at a time."""
    step = max(16, TILE_BYTES // (4 * in_features))
    y = torch.empty(*x.shape[:-1], out_features, dtype=x.dtype, device=x.device)
    for start in range(0, out_features, step):
        stop = min(start + step, out_features)
        y[..., start:stop] = F.linear(x, rows_of(slice(start, stop)).to(x.dtype))
    return with_bias(y, bias)


def group_codes(packed: torch.Tensor) -> torch.Tensor:
    """Nibble bytes [r, G, 16] (inputs k and k + 16 of a group in one byte, Q4_0's layout) -> the
    4-bit codes [r, G, 32] in input order."""
    return torch.cat([packed & 0xF, packed >> 4], dim=-1)


def group_scales(field: torch.Tensor, mult: torch.Tensor | int, index: slice | torch.Tensor, per: int) -> torch.Tensor:
    """Float32 scale of each group of 32 in rows `index`: an interleaved float16 field held per `per` groups,
    times its integer multiplier (an interleaved field per group, or one for all)."""
    mult = lane_rows(mult, index) if torch.is_tensor(mult) else mult
    return lane_rows(field, index).float().repeat_interleave(per, dim=1) * mult


def interleave(rows: torch.Tensor) -> torch.Tensor:
    """A field [out, *rest] -> [blocks, *rest, LANES]: LANES rows side by side in the last axis, zero rows
    appended to fill the last block."""
    pad = -rows.shape[0] % LANES
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, *rows.shape[1:])])
    return rows.reshape(-1, LANES, *rows.shape[1:]).movedim(1, -1).contiguous()


def lane_rows(field: torch.Tensor, index: slice | torch.Tensor) -> torch.Tensor:
    """Rows `index` (a slice, or row numbers: a tied embedding's lookup) of an interleaved field -> [n, *rest]."""
    if isinstance(index, slice):
        start, stop, _ = index.indices(field.shape[0] * LANES)
        first = start // LANES
        part = field[first:-(-stop // LANES)].movedim(-1, 1)
        return part.reshape(-1, *part.shape[2:])[start - first * LANES:stop - first * LANES].contiguous()
    return field.movedim(-1, 1)[index // LANES, index % LANES]


class FieldLinear(nn.Module):
    """A weight held as its GGUF type's fields, each with LANES rows interleaved (`interleave`).
    `rows` rebuilds float32 rows with gguf's arithmetic (prefill's tiles, a tied embedding's lookup); a
    decode step's one input row takes the class's `gemv` over `fields()`, compiled (gguf_gemv.py), or
    the tiles where it cannot compile."""

    gemv: Callable[..., torch.Tensor]
    shared: tuple[str, ...] = ()  # buffers of the whole layer, not per row: stacked parts must hold equal ones
    _bound: tuple[tuple[int, ...], Callable[[torch.Tensor], torch.Tensor]] | None = None  # (buffer ids, product)
    bias: nn.Parameter | None
    out_features: int
    in_features: int

    def fields(self) -> tuple:
        """The arguments `gemv` takes after x."""
        raise NotImplementedError

    def register_rows(self, name: str, rows: torch.Tensor | None) -> None:
        """Hold field `name` [out, *rest] interleaved."""
        self.register_buffer(name, None if rows is None else interleave(rows))

    def rows(self, index: slice | torch.Tensor) -> torch.Tensor:
        """Float32 rows of W (a slice, or row numbers: a tied embedding's lookup), bit for bit gguf's."""
        raise NotImplementedError

    def product(self, x: torch.Tensor) -> torch.Tensor | None:
        """x [in] (float32) times W, padding rows included: the compiled gemv, bound to this module's fields
        on the first call and bound again if they were replaced (`.to()`, arena.pack_contiguously); None
        where it cannot compile. Inside a compiled decode step, the gemv itself: part of the step's graph."""
        if torch.compiler.is_compiling():
            return self.gemv(x, *self.fields())
        held = tuple(map(id, self._buffers.values()))  # (the bound product holds them: no id is reused)
        if self._bound is None or self._bound[0] != held:
            product = bind_product(self.gemv, x, self.fields())
            if product is None:
                return None
            self._bound = (held, product)
        return self._bound[1](x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if one_row(x):
            y = self.product(x.reshape(-1).float().contiguous())
            if y is not None:
                return with_bias(y[:self.out_features] if len(y) > self.out_features else y, self.bias, like=x)
        return tiled_linear(x, self.out_features, self.in_features, self.rows, self.bias)


# legacy 32-blocks whose codes are nibbles (+ a fifth bit in `qh`): bytes per block, offset of
# `qh` (None: 4-bit), of the nibbles, whether a float16 `m` follows `d`, and the code offset of
# the symmetric types (W = d (q - offset))
LEGACY_NIBBLES = {Q.Q4_0: (18, None, 2, False, 8), Q.Q4_1: (20, None, 4, True, 0),
                  Q.Q5_0: (22, 2, 6, False, 16), Q.Q5_1: (24, 4, 8, True, 0)}
NIBBLE_TYPES = (*LEGACY_NIBBLES, Q.Q4_K, Q.Q5_K)


class NibbleLinear(FieldLinear):
    """Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q5_K: W = q * (a * a_mult) - b * b_mult per 32 inputs, with q's low four
    bits two a byte (inputs k and k + 16 of a group) and, for Q5, the fifth bits as the file's
    little-endian `qh` read into a native int32 per group (gguf_gemv.fifth_bits); float16 a and b per `per` groups, and small integer multipliers: Q4_0/Q5_0
    a = d, b = d * offset and Q4_1/Q5_1 a = d, b = -m with one multiplier for all groups (a uint8 per
    group would add 11% to a Q4_0 model); Q4_K/Q5_K a = d * sc, b = dmin * m with the six-bit sc and m per
    group (Q5_K's fifth bits regrouped into Q5_0's words at load: _k5_high_words). The products and the
    difference are gguf's own, so the float32 weights are the reference
    dequantizer's."""

    gemv = staticmethod(nibble_gemv)

    def __init__(self, qtype: GGMLQuantType, data: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        out = data.shape[0]
        high = None
        if qtype in (Q.Q4_K, Q.Q5_K):
            codes, a, b, a_mult, b_mult = _k_fields(data) if qtype == Q.Q4_K else _k_fields(data, 176, 48)
            q = codes.reshape(out, -1, 2, 16)
            nibbles = (q[:, :, 0] | (q[:, :, 1] << 4)).to(torch.uint8)
            high = _k5_high_words(data) if qtype == Q.Q5_K else None
        else:
            size, qh, qs, has_m, offset = LEGACY_NIBBLES[qtype]
            blocks = data.reshape(-1, size)
            nibbles = blocks[:, qs:].reshape(out, -1, 16)  # already the layout above
            if qh is not None:
                words = np.ascontiguousarray(blocks[:, qh:qh + 4].numpy()).view("<u4").astype(np.int32)
                high = torch.from_numpy(words).reshape(out, -1, 1)  # the file's little-endian qh, native
            a = blocks[:, 0:2].contiguous().view(torch.float16).reshape(out, -1)
            b = -blocks[:, 2:4].contiguous().view(torch.float16).reshape(out, -1) if has_m else a
            a_mult, b_mult = 1, 1 if has_m else offset  # the same for every group: not stored per group
        self.register_rows("codes", nibbles)  # [out, G, 16]
        self.register_rows("high", high)  # [out, G, 1] int32
        self.register_rows("a", a)
        if b is a:
            self.register_buffer("b", self.a)  # Q4_0/Q5_0: b = offset * a, held once
        else:
            self.register_rows("b", b)
        if torch.is_tensor(a_mult):  # Q4_K's six-bit sub-block scales and mins
            self.register_rows("a_mult", a_mult.to(torch.uint8))
            self.register_rows("b_mult", b_mult.to(torch.uint8))
        else:
            self.a_mult, self.b_mult = a_mult, b_mult
        self.per = nibbles.shape[1] // a.shape[1]
        self.out_features, self.in_features = out, nibbles.shape[1] * 32
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def rows(self, index: slice | torch.Tensor) -> torch.Tensor:
        p = lane_rows(self.codes, index)
        q = group_codes(p)
        if self.high is not None:
            q = q | (fifth_bits(lane_rows(self.high, index)).to(torch.uint8) << 4)
        q = q.float()
        a = group_scales(self.a, self.a_mult, index, self.per)
        b = group_scales(self.b, self.b_mult, index, self.per)
        return q.mul_(a[..., None]).sub_(b[..., None]).reshape(p.shape[0], -1)  # in place: ~5x faster than q * a - b

    def fields(self) -> tuple:
        return (self.codes, self.high, self.a, self.b, self.a_mult, self.b_mult, self.per)


class Int8GroupLinear(FieldLinear):
    """Q8_0: int8 codes [out, in] and a float16 scale per 32 inputs; W = q * d, exact in float32."""

    gemv = staticmethod(int8_gemv)

    def __init__(self, data: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        b = data.reshape(-1, 34)
        self.out_features = data.shape[0]
        self.register_rows("codes", b[:, 2:].contiguous().view(torch.int8).reshape(self.out_features, -1, 32))
        self.register_rows("scales", b[:, :2].contiguous().view(torch.float16).reshape(self.out_features, -1, 1))
        self.in_features = self.codes.shape[1] * 32
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def rows(self, index: slice | torch.Tensor) -> torch.Tensor:
        codes = lane_rows(self.codes, index)
        return codes.float().mul_(lane_rows(self.scales, index).float()).reshape(codes.shape[0], -1)

    def fields(self) -> tuple:
        return (self.codes, self.scales)


class Q6KLinear(FieldLinear):
    """Q6_K: the block's fields apart (low nibbles, high bit pairs, int8 sub-block scales, float16 d),
    W = d sc (q - 32) rebuilt per tile with gguf's float32 products (exact), or the compiled product."""

    gemv = staticmethod(q6_k_gemv)

    def __init__(self, data: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        out = data.shape[0]
        b = data.reshape(out, -1, 210)
        self.register_rows("ql", b[..., :128])
        self.register_rows("qh", b[..., 128:192])
        self.register_rows("scales", b[..., 192:208].contiguous().view(torch.int8))
        self.register_rows("d", b[..., 208:210].contiguous().view(torch.float16).reshape(out, -1))
        self.out_features, self.in_features = out, b.shape[1] * 256
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def rows(self, index: slice | torch.Tensor) -> torch.Tensor:
        q = q6_k_codes(lane_rows(self.ql, index), lane_rows(self.qh, index)).to(torch.int8).sub_(32).float()
        n, blocks = q.shape[:2]
        scale = lane_rows(self.d, index).float()[..., None] * lane_rows(self.scales, index).float()  # [n, blocks, 16]
        return (scale[..., None] * q.reshape(n, blocks, 16, 16)).reshape(n, -1)

    def fields(self) -> tuple:
        return (self.ql, self.qh, self.scales, self.d)


def _q3_k_scales(packed: torch.Tensor) -> torch.Tensor:
    """Q3_K's 12 bytes [n, 12] -> its 16 six-bit scales less 32, int8 [n, 16]: scale i's low four bits are
    byte i's low nibble (i < 8) or byte i - 8's high one, its top two bits bits 2 (i // 4) of byte 8 + i % 4."""
    low = torch.cat([packed[:, :8] & 15, packed[:, :8] >> 4], dim=1)
    top = (packed[:, 8:12].repeat(1, 4) >> torch.arange(0, 8, 2, dtype=torch.uint8).repeat_interleave(4)) & 3
    return (low | (top << 4)).to(torch.int8) - 32


class KLowLinear(FieldLinear):
    """Q2_K and Q3_K: two-bit codes (qs) and Q3_K's third bits (hmask) as the file holds them, a float16
    d per 256 inputs, and a scale per 16: Q2_K's scale/min byte (W = d (sc & 15) q - dmin (sc >> 4)) or
    Q3_K's six-bit scale unpacked to int8 (W = d (sc - 32) q, q in -4..3). Rows rebuilt with gguf's
    float32 products (exact), or the compiled product."""

    gemv = staticmethod(k_low_gemv)

    def __init__(self, qtype: GGMLQuantType, data: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        out = data.shape[0]
        if qtype == Q.Q2_K:  # scales[16], qs[64], d, dmin
            b = data.reshape(out, -1, 84)
            qs, hmask, scales = b[..., 16:80], None, b[..., :16]
            d, dmin = b[..., 80:82], b[..., 82:84]
        else:  # Q3_K: hmask[32], qs[64], scales[12], d
            b = data.reshape(out, -1, 110)
            qs, hmask, scales = b[..., 32:96], b[..., :32], _q3_k_scales(b[..., 96:108].reshape(-1, 12))
            d, dmin = b[..., 108:110], None
        blocks = b.shape[1]
        self.register_rows("qs", qs)
        self.register_rows("hmask", hmask)
        self.register_rows("scales", scales.reshape(out, blocks, 16))
        self.register_rows("d", d.contiguous().view(torch.float16).reshape(out, blocks))
        self.register_rows("dmin", None if dmin is None else dmin.contiguous().view(torch.float16).reshape(out, blocks))
        self.out_features, self.in_features = out, blocks * 256
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def rows(self, index: slice | torch.Tensor) -> torch.Tensor:
        hmask = None if self.hmask is None else lane_rows(self.hmask, index)
        q = k_low_codes(lane_rows(self.qs, index), hmask).float()
        scales, d = lane_rows(self.scales, index), lane_rows(self.d, index).float()[..., None]
        if self.dmin is None:
            w = (d * scales.float())[..., None] * q
        else:
            mins = lane_rows(self.dmin, index).float()[..., None] * (scales >> 4).float()
            w = (d * (scales & 15).float())[..., None] * q - mins[..., None]
        return w.reshape(q.shape[0], -1)

    def fields(self) -> tuple:
        return (self.qs, self.hmask, self.d, self.scales, self.dmin)


class IQ4Linear(FieldLinear):
    """IQ4_NL and IQ4_XS: 4-bit indices into llama.cpp's 16 levels v (codebooks.IQ4_VALUES), two a byte as
    Q4_0's nibbles; W = v[q] d per 32 inputs (IQ4_NL), or v[q] (d (ls - 32)) with d per 256 and a six-bit
    ls per 32 (IQ4_XS; ls unpacked to int8 at load: 137 bytes a block for 136)."""

    gemv = staticmethod(iq4_gemv)
    shared = ("lookup",)  # the levels, a buffer so that they move with the module (CUDA)

    def __init__(self, qtype: GGMLQuantType, data: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.register_buffer("lookup", IQ4_LEVELS, persistent=False)
        out = data.shape[0]
        if qtype == Q.IQ4_NL:  # d, qs[16]
            b = data.reshape(out, -1, 18)
            codes, self.a_mult = b[..., 2:], 1
        else:  # IQ4_XS: d, scales_h (16 bits), scales_l[4], qs[128]
            b = data.reshape(out, -1, 136)
            codes = b[..., 8:].reshape(out, -1, 16)
            low = b[..., 4:8].repeat_interleave(2, dim=-1) >> torch.tensor([0, 4], dtype=torch.uint8).repeat(4)
            high = b[..., 2:4].contiguous().view(torch.int16).to(torch.int32)  # bits 2i, 2i + 1: sub-block i's
            high = high >> torch.arange(0, 16, 2, dtype=torch.int32)
            ls = (low & 15).to(torch.int32) | ((high & 3) << 4)  # [out, blocks, 8]
            self.register_rows("a_mult", (ls - 32).to(torch.int8).reshape(out, -1))
        self.register_rows("codes", codes)
        self.register_rows("a", b[..., :2].contiguous().view(torch.float16).reshape(out, -1))
        self.per = codes.shape[1] // self.a.shape[1]
        self.out_features, self.in_features = out, codes.shape[1] * 32
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def fields(self) -> tuple:
        return (self.codes, self.a, self.a_mult, self.per)

    def rows(self, index: slice | torch.Tensor) -> torch.Tensor:
        p = lane_rows(self.codes, index)
        scale = group_scales(self.a, self.a_mult, index, self.per)
        return (scale[..., None] * self.lookup[group_codes(p).long()]).reshape(p.shape[0], -1)


class F16Linear(FieldLinear):
    """F16: the float16 weight as stored, widened to float32 per tile, or read by the compiled product."""

    gemv = staticmethod(f16_gemv)

    def __init__(self, data: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        weight = data.contiguous().view(torch.float16)
        self.register_rows("weight", weight)
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def rows(self, index: slice | torch.Tensor) -> torch.Tensor:
        return lane_rows(self.weight, index).float()

    def fields(self) -> tuple:
        return (self.weight,)


def block_field(blocks: torch.Tensor, start: int, stop: int, dtype: torch.dtype, *shape: int) -> torch.Tensor:
    """Bytes [start, stop) of each block [out, blocks, size] as `dtype`, shaped [out, blocks, *shape] (a copy:
    a field of its own, not a view into the file's bytes)."""
    part = blocks[:, :, start:stop].clone(memory_format=torch.contiguous_format)
    return part.view(dtype).reshape(*blocks.shape[:2], *shape)


def split_names(split_fields: Callable[[GGMLQuantType, torch.Tensor], dict[str, torch.Tensor]],
                types: Iterable[GGMLQuantType]) -> dict[GGMLQuantType, tuple[str, ...]]:  # fmt: skip
    """The names `split_fields` gives each type's fields, in order (what a family's gemv receives them as)."""
    return {q: tuple(split_fields(q, torch.zeros(1, GGML_TYPES_BY_ID[q].nbytes, dtype=torch.uint8))) for q in types}


class SplitFieldLinear(FieldLinear):
    """A weight held as its blocks' own bytes split by role (a type family's `split_fields`: the same memory
    as the file), read back by the family's `values` (rows, bit for bit gguf's) and its `gemv` (a decode
    step), each given the fields in `split_fields`'s order (`field_names`) and the type's lookup `table`
    (gguf_lattice.py, gguf_codes.py), held as a buffer so that it moves with the module (CUDA)."""

    shared = ("lookup",)

    split_fields: Callable[[GGMLQuantType, torch.Tensor], dict[str, torch.Tensor]]
    values: Callable[[GGMLQuantType, dict[str, torch.Tensor], torch.Tensor], torch.Tensor]
    table: Callable[[GGMLQuantType], torch.Tensor]
    field_names: dict[GGMLQuantType, tuple[str, ...]]

    def __init__(self, qtype: GGMLQuantType, data: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.kind = qtype.name
        self.register_buffer("lookup", self.table(qtype), persistent=False)
        for name, field in self.split_fields(qtype, data).items():
            self.register_rows(name, field)
        _, _, block, size = GGML_TYPES_BY_ID[qtype]
        self.out_features, self.in_features = data.shape[0], data.shape[1] // size * block
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @property
    def qtype(self) -> GGMLQuantType:
        return Q[self.kind]

    def fields(self) -> tuple:
        return (self.kind, self.lookup, *(self._buffers[n] for n in self.field_names[self.qtype]))

    def rows(self, index: slice | torch.Tensor) -> torch.Tensor:
        names = self.field_names[self.qtype]
        return self.values(self.qtype, {n: lane_rows(self._buffers[n], index) for n in names}, self.lookup)


class RawGGUFLinear(nn.Module):
    """Any GGUF type: the block bytes, dequantized one tile of rows at a time inside forward."""

    def __init__(self, qtype: GGMLQuantType, data: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.qtype = qtype
        self.register_buffer("blocks", data)
        _, _, block, size = GGML_TYPES_BY_ID[qtype]
        self.out_features, self.in_features = data.shape[0], data.shape[1] // size * block
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def rows(self, index: slice | torch.Tensor) -> torch.Tensor:
        return dequantize_rows(self.qtype, self.blocks[index])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tiled_linear(x, self.out_features, self.in_features, self.rows, self.bias)


class QuantizedEmbedding(nn.Module):
    """Token embeddings read from a quantized module's rows, dequantizing only the rows looked up: the
    tied LM head's (the table held once) or the table's own module (linear.quantized_module's `rows`).
    Torch ops on the module's device but for a type without a field module (RawGGUFLinear's rows: numpy,
    on the CPU)."""

    def __init__(self, table: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.table, self.dtype = table, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.rows(ids.reshape(-1)).reshape(*ids.shape, -1).to(self.dtype)


def _layout(m: nn.Module) -> tuple:
    """What must agree for rows to stack: the class, the plain attributes but the row count (multipliers,
    groups per scale, widths), and which buffers and bias are absent."""
    plain = {k: v for k, v in vars(m).items() if not k.startswith("_") and k != "out_features"}
    return type(m), plain, [b is None for b in (*m._buffers.values(), m.bias)]


def stacked(modules: list[nn.Module]) -> nn.Module | None:
    """One module for linears that read the same input (q/k/v, gate/up: `row_major.fuse_shared_inputs`),
    their rows one after another, where all have the same class and layout (a Q4_K q with a Q6_K v:
    None). A decode step then makes one product where it made three: SmolLM2 calls 120, not 210."""
    first = modules[0]
    if not isinstance(first, FieldLinear):
        return None
    layout = _layout(first)
    if any(_layout(m) != layout for m in modules):
        return None
    if any(not torch.equal(m._buffers[n], first._buffers[n]) for n in first.shared if first._buffers[n] is not None
           for m in modules):  # fmt: skip
        return None
    fused = type(first).__new__(type(first))
    nn.Module.__init__(fused)
    vars(fused).update(layout[1])
    fused.out_features = sum(m.out_features for m in modules)
    made: dict[int, torch.Tensor] = {}  # by the first part's buffer: one that is another (Q4_0's b is its a) stays one
    for name, buf in first._buffers.items():
        if name in first.shared:
            fused.register_buffer(name, buf)
            continue
        if buf is not None and id(buf) not in made:
            made[id(buf)] = interleave(torch.cat([lane_rows(m._buffers[name], slice(0, m.out_features))
                                                  for m in modules]))
        fused.register_buffer(name, None if buf is None else made[id(buf)])
    fused.bias = None if first.bias is None else nn.Parameter(torch.cat([m.bias for m in modules]), requires_grad=False)
    return fused
