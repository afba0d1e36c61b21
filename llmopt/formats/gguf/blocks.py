"""Block packing: a grid's QuantizedTensor -> the bytes of llama.cpp's block structs (ggml-common.h).

One small packer per block type, vectorized over all blocks of a tensor. Each reads the codes and the
raw per-block fields that the grid keeps in `QuantizedTensor.aux` (fp16 `d`/`dmin`/`m`, integer
sub-scales `sc` and sub-mins `m`) and lays them out exactly as the C structs do, so llama.cpp and
`gguf.quants.dequantize` read the same values the grid chose.
"""

from __future__ import annotations

import numpy as np
import torch

from llmopt.errors import InputError
from llmopt.model.ggml_types import PARTS
from llmopt.quant.grids.fp4 import INDEX_OF_CODE as FP4_INDEX_OF_CODE
from llmopt.quant.grids.iq1 import CODE_STEP as IQ1_CODE_STEP
from llmopt.quant.grids.iq1 import IQ1_LATTICE
from llmopt.quant.grids.iq4 import IQ4_LEVELS
from llmopt.quant.grids.iq_lattice import IQ2_S_LATTICE, IQ2_XS_LATTICE, IQ2_XXS_LATTICE, IQ3_S_LATTICE, IQ3_XXS_LATTICE
from llmopt.quant.grids.lattice import Lattice
from llmopt.quant.grids.ternary import ZERO_CODE
from llmopt.quantized_tensor import QuantizedTensor


def _half_bytes(t: torch.Tensor) -> torch.Tensor:
    """fp16 values [n] -> their little-endian bytes [n, 2]."""
    return t.to(torch.float16).contiguous().view(torch.uint8).reshape(-1, 2)


def _u8(t: torch.Tensor) -> torch.Tensor:
    """Codes and integer fields as uint8 (a no-op for the grids' outputs): every packer below keeps
    its shifted values under 256, so the bit arithmetic runs on bytes without widening."""
    return t.to(torch.uint8)


def _nibbles(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    return (lo & 0xF) | (hi << 4)


def _crumbs(q: torch.Tensor) -> torch.Tensor:
    """2-bit levels of 128-element halves [n, 2, 128] -> bytes [n, 64]: 4 levels 32 apart per byte."""
    q = q.reshape(q.shape[0], 2, 4, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)).reshape(-1, 64).to(torch.uint8)


_GATHER_BITS = np.uint64(0x0102040810204080)  # Σ 2^(56-7k): byte k's low bit lands on bit 56+k, no carries


def _high_bits_32(q: torch.Tensor) -> torch.Tensor:
    """Bit 4 of each of a 32-block's levels as the little-endian uint32 `qh` [n, 4] (bit k = level k).
    Eight levels at a time as one little-endian uint64: shifted so each byte's bit 4 is its bit 0,
    then gathered into the top byte by one multiplication (8x fewer elements than a per-level pass)."""
    words = _u8(q).reshape(-1, 32).cpu().contiguous().numpy().view(np.uint64)  # [n, 4]: 8 levels each
    low = (words >> np.uint64(4)) & np.uint64(0x0101010101010101)
    return torch.from_numpy(((low * _GATHER_BITS) >> np.uint64(56)).astype(np.uint8)).to(q.device)


def _k_scales_6bit(sc: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K: 8 six-bit scales and 8 six-bit mins [n, 8] -> 12 bytes (get_scale_min_k4's layout)."""
    sc, m = _u8(sc), _u8(m)
    out = torch.empty(sc.shape[0], 12, dtype=torch.uint8, device=sc.device)
    out[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    return out


def _q3_scales(stored: torch.Tensor) -> torch.Tensor:
    """Q3_K: 16 six-bit (biased) scales [n, 16] -> 12 bytes: low nibbles in 0..7, high 2 bits in 8..11."""
    s = _u8(stored)
    out = torch.zeros(s.shape[0], 12, dtype=torch.uint8, device=s.device)
    out[:, 0:8] = (s[:, 0:8] & 0xF) | ((s[:, 8:16] & 0xF) << 4)
    hi = s >> 4  # [n, 16]; byte 8 + j%4 holds bits at 2*(j/4)
    for quarter in range(4):
        out[:, 8:12] |= hi[:, 4 * quarter : 4 * quarter + 4] << (2 * quarter)
    return out


def pack_q8_0(qt: QuantizedTensor) -> torch.Tensor:
    q = (_u8(qt.codes) ^ 0x80).reshape(-1, 32)  # stored +128: the int8 code's byte flips the top bit
    return torch.cat([_half_bytes(qt.aux["d"].reshape(-1)), q], dim=1)


def pack_q4_0(qt: QuantizedTensor) -> torch.Tensor:
    q = _u8(qt.codes).reshape(-1, 32)
    return torch.cat([_half_bytes(qt.aux["d"].reshape(-1)), _nibbles(q[:, :16], q[:, 16:])], dim=1)


def pack_q4_1(qt: QuantizedTensor) -> torch.Tensor:
    q = _u8(qt.codes).reshape(-1, 32)
    head = [_half_bytes(qt.aux["d"].reshape(-1)), _half_bytes(qt.aux["m"].reshape(-1))]
    return torch.cat([*head, _nibbles(q[:, :16], q[:, 16:])], dim=1)


def pack_q5_0(qt: QuantizedTensor) -> torch.Tensor:
    q = _u8(qt.codes).reshape(-1, 32)
    return torch.cat([_half_bytes(qt.aux["d"].reshape(-1)), _high_bits_32(q), _nibbles(q[:, :16], q[:, 16:])], dim=1)


def pack_q5_1(qt: QuantizedTensor) -> torch.Tensor:
    q = _u8(qt.codes).reshape(-1, 32)
    head = [_half_bytes(qt.aux["d"].reshape(-1)), _half_bytes(qt.aux["m"].reshape(-1))]
    return torch.cat([*head, _high_bits_32(q), _nibbles(q[:, :16], q[:, 16:])], dim=1)


def pack_q2_k(qt: QuantizedTensor) -> torch.Tensor:
    q = _u8(qt.codes).reshape(-1, 256)
    scales = (_u8(qt.aux["sc"]) | (_u8(qt.aux["m"]) << 4)).reshape(-1, 16).to(torch.uint8)
    d = _half_bytes(qt.aux["d"].reshape(-1))
    dmin = _half_bytes(qt.aux["dmin"].reshape(-1))
    return torch.cat([scales, _crumbs(q), d, dmin], dim=1)


def pack_q3_k(qt: QuantizedTensor) -> torch.Tensor:
    q = _u8(qt.codes).reshape(-1, 256)
    high = (q >> 2) & 1  # level > 3
    bits = high.reshape(-1, 8, 32) << torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1)
    hmask = bits.sum(1).to(torch.uint8)  # bit b of hmask[m] = level 32*b + m
    scales = _q3_scales(qt.aux["sc"].reshape(-1, 16))
    return torch.cat([hmask, _crumbs(q & 3), scales, _half_bytes(qt.aux["d"].reshape(-1))], dim=1)


def pack_q4_k(qt: QuantizedTensor) -> torch.Tensor:
    q = _u8(qt.codes).reshape(-1, 4, 2, 32)
    qs = _nibbles(q[:, :, 0], q[:, :, 1]).reshape(-1, 128)
    head = [_half_bytes(qt.aux["d"].reshape(-1)), _half_bytes(qt.aux["dmin"].reshape(-1))]
    return torch.cat([*head, _k_scales_6bit(qt.aux["sc"].reshape(-1, 8), qt.aux["m"].reshape(-1, 8)), qs], dim=1)


def pack_q5_k(qt: QuantizedTensor) -> torch.Tensor:
    q = _u8(qt.codes).reshape(-1, 4, 2, 32)
    qs = _nibbles(q[:, :, 0], q[:, :, 1]).reshape(-1, 128)
    shifts = torch.arange(8, dtype=torch.uint8).reshape(1, 4, 2, 1)  # level n*64 + h*32 + j -> bit 2n + h
    qh = (((q >> 4) & 1) << shifts).sum(dim=(1, 2)).to(torch.uint8)
    head = [_half_bytes(qt.aux["d"].reshape(-1)), _half_bytes(qt.aux["dmin"].reshape(-1))]
    scales = _k_scales_6bit(qt.aux["sc"].reshape(-1, 8), qt.aux["m"].reshape(-1, 8))
    return torch.cat([*head, scales, qh, qs], dim=1)


def pack_q6_k(qt: QuantizedTensor) -> torch.Tensor:
    q = _u8(qt.codes).reshape(-1, 2, 4, 32)  # [n, half, quarter, 32]
    ql = torch.cat([_nibbles(q[:, :, 0], q[:, :, 2]), _nibbles(q[:, :, 1], q[:, :, 3])], dim=2).reshape(-1, 128)
    hi = q >> 4
    qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(-1, 64)
    scales = qt.aux["sc"].reshape(-1, 16).to(torch.int8).view(torch.uint8)
    return torch.cat([ql, qh.to(torch.uint8), scales, _half_bytes(qt.aux["d"].reshape(-1))], dim=1)


def _iq4_indices(qt: QuantizedTensor, n: int) -> torch.Tensor:
    """IQ4 codes (level + 128) -> the 4-bit indices into the level table, [blocks, n]."""
    return IQ4_LEVELS.index_of_code[qt.codes.to(torch.int64)].reshape(-1, n)


def pack_iq4_nl(qt: QuantizedTensor) -> torch.Tensor:
    q = _iq4_indices(qt, 32)
    return torch.cat([_half_bytes(qt.aux["d"].reshape(-1)), _nibbles(q[:, :16], q[:, 16:])], dim=1)


def pack_iq4_xs(qt: QuantizedTensor) -> torch.Tensor:
    q = _iq4_indices(qt, 256).reshape(-1, 8, 32)
    qs = _nibbles(q[:, :, :16], q[:, :, 16:]).reshape(-1, 128)
    sc = _u8(qt.aux["sc"]).reshape(-1, 8)  # 6-bit ls per sub-block: low nibbles paired, high 2 bits in a uint16
    scales_l = (sc[:, 0::2] & 0xF) | ((sc[:, 1::2] & 0xF) << 4)
    hi = sc >> 4
    scales_h = [hi[:, 4 * b] | (hi[:, 4 * b + 1] << 2) | (hi[:, 4 * b + 2] << 4) | (hi[:, 4 * b + 3] << 6) for b in (0, 1)]
    head = [_half_bytes(qt.aux["d"].reshape(-1)), torch.stack(scales_h, dim=1)]
    return torch.cat([*head, scales_l, qs], dim=1)


def pack_tq2_0(qt: QuantizedTensor) -> torch.Tensor:
    t = (_u8(qt.codes) - (ZERO_CODE - 1)).reshape(-1, 2, 4, 32)  # t + 1 in 0..2; [n, half, shift, 32]
    qs = (t[:, :, 0] | (t[:, :, 1] << 2) | (t[:, :, 2] << 4) | (t[:, :, 3] << 6)).reshape(-1, 64)
    return torch.cat([qs, _half_bytes(qt.aux["d"].reshape(-1))], dim=1)


def pack_q1_0(qt: QuantizedTensor) -> torch.Tensor:
    bits = _u8(qt.codes).reshape(-1, 16, 8).numpy()  # value j: byte j/8, bit j%8 (1: +d)
    qs = torch.from_numpy(np.packbits(bits, axis=-1, bitorder="little").reshape(-1, 16))
    return torch.cat([_half_bytes(qt.aux["d"].reshape(-1)), qs], dim=1)


def pack_q2_0(qt: QuantizedTensor) -> torch.Tensor:
    q = _u8(qt.codes).reshape(-1, 16, 4)  # value j: byte j/4, bits 2·(j%4)
    qs = q[..., 0] | (q[..., 1] << 2) | (q[..., 2] << 4) | (q[..., 3] << 6)
    return torch.cat([_half_bytes(qt.aux["d"].reshape(-1)), qs], dim=1)


def _base3(t: torch.Tensor) -> torch.Tensor:
    """Digits t [n, k, m] (k most significant first, up to 5) -> one byte per m, the number in base 3
    scaled to 0..255 by ceil(q·256/243) (as ggml packs TQ1_0)."""
    q = torch.zeros(t.shape[0], t.shape[2], dtype=torch.int32)
    for k in range(t.shape[1]):
        q = q * 3 + t[:, k]
    q = q * 3 ** (5 - t.shape[1])
    return ((q * 256 + 242) // 243).to(torch.uint8)


def pack_tq1_0(qt: QuantizedTensor) -> torch.Tensor:
    t = (qt.codes.to(torch.int32) - (ZERO_CODE - 1)).reshape(-1, 256)  # t + 1 in 0..2
    qs = [_base3(t[:, :160].reshape(-1, 5, 32)), _base3(t[:, 160:240].reshape(-1, 5, 16))]
    qh = _base3(t[:, 240:].reshape(-1, 4, 4))
    return torch.cat([*qs, qh, _half_bytes(qt.aux["d"].reshape(-1))], dim=1)


def pack_mxfp4(qt: QuantizedTensor) -> torch.Tensor:
    q = FP4_INDEX_OF_CODE[qt.codes.to(torch.int64)].reshape(-1, 32)
    return torch.cat([_u8(qt.aux["e"]).reshape(-1, 1), _nibbles(q[:, :16], q[:, 16:])], dim=1)


def pack_nvfp4(qt: QuantizedTensor) -> torch.Tensor:
    q = FP4_INDEX_OF_CODE[qt.codes.to(torch.int64)].reshape(-1, 4, 16)  # 4 sub-blocks of 16
    qs = _nibbles(q[:, :, :8], q[:, :, 8:]).reshape(-1, 32)
    return torch.cat([_u8(qt.aux["ue"]).reshape(-1, 4), qs], dim=1)


def _lattice_fields(qt: QuantizedTensor, lattice: Lattice, parity: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """IQ2/IQ3 codes (±value + 128) -> every group's point index [groups] and the stored sign bits of
    every 8 values [values/8] (`parity`: 7 bits, the count must be even), in element order; refuses
    codes off the lattice."""
    v = qt.codes.to(torch.int64).reshape(-1, 8) - 128
    level_of = torch.full((256,), -1, dtype=torch.int64)
    level_of[torch.tensor(lattice.levels)] = torch.arange(lattice.nlevels)
    levels = level_of[v.abs()].reshape(-1, lattice.dims)
    index = lattice.index_of_key[lattice.key(levels.clamp(min=0))]
    negative = (v < 0).to(torch.int64)
    odd = (negative.sum(dim=-1) % 2 == 1).any() if parity else torch.tensor(False)
    if bool((levels < 0).any() | (index < 0).any() | odd):
        raise InputError(f"{qt.grid} codes that are not points of its lattice (with an even count of signs)")
    signs = (negative * (1 << torch.arange(8))).sum(dim=-1) & (127 if parity else 255)
    return index, signs


def _u32_bytes(t: torch.Tensor) -> torch.Tensor:
    """uint32 values (held in int64) [n, k] -> their little-endian bytes [n, 4k]."""
    return t.to(torch.int64).unsqueeze(-1).bitwise_right_shift(torch.arange(0, 32, 8)).bitwise_and(255).reshape(t.shape[0], -1).to(torch.uint8)


def _scales_and_signs(signs: torch.Tensor, sc: torch.Tensor) -> torch.Tensor:
    """Four 7-bit sign sets and the 4-bit scale of a sub-block as llama.cpp's uint32 [n] (signs at 0, 7, 14, 21; scale at 28)."""
    return (signs * torch.tensor([1, 1 << 7, 1 << 14, 1 << 21])).sum(dim=-1) | (sc.to(torch.int64) << 28)


def pack_iq3_xxs(qt: QuantizedTensor) -> torch.Tensor:
    index, signs = _lattice_fields(qt, IQ3_XXS_LATTICE)
    aux = _scales_and_signs(signs.reshape(-1, 4), qt.aux["sc"].reshape(-1)).reshape(-1, 8)
    return torch.cat([_half_bytes(qt.aux["d"].reshape(-1)), index.reshape(-1, 64).to(torch.uint8), _u32_bytes(aux)], dim=1)


def pack_iq2_xxs(qt: QuantizedTensor) -> torch.Tensor:
    index, signs = _lattice_fields(qt, IQ2_XXS_LATTICE)
    aux = _scales_and_signs(signs.reshape(-1, 4), qt.aux["sc"].reshape(-1))
    pairs = torch.cat([index.reshape(-1, 4).to(torch.uint8), _u32_bytes(aux[:, None])], dim=1)  # per 32: 4 indices, the uint32
    return torch.cat([_half_bytes(qt.aux["d"].reshape(-1)), pairs.reshape(-1, 64)], dim=1)


def pack_iq2_xs(qt: QuantizedTensor) -> torch.Tensor:
    index, signs = _lattice_fields(qt, IQ2_XS_LATTICE)
    qs = (index | (signs << 9)).reshape(-1, 32).to(torch.int16).view(torch.uint8).reshape(-1, 64)  # uint16: 9-bit point, 7 signs
    sc = _u8(qt.aux["sc"]).reshape(-1, 8, 2)
    return torch.cat([_half_bytes(qt.aux["d"].reshape(-1)), qs, _nibbles(sc[:, :, 0], sc[:, :, 1])], dim=1)


def pack_iq3_s(qt: QuantizedTensor) -> torch.Tensor:
    index, signs = _lattice_fields(qt, IQ3_S_LATTICE, parity=False)
    index = index.reshape(-1, 8, 8)  # [n, sub-block, group]: 9th bit of sub-block b's group k is qh[b] bit k
    qh = ((index >> 8) << torch.arange(8)).sum(dim=-1)
    sc = _u8(qt.aux["sc"]).reshape(-1, 4, 2)
    parts = [index.reshape(-1, 64) & 255, qh, signs.reshape(-1, 32), _nibbles(sc[:, :, 0], sc[:, :, 1])]
    return torch.cat([_half_bytes(qt.aux["d"].reshape(-1)), *(p.to(torch.uint8) for p in parts)], dim=1)


def pack_iq2_s(qt: QuantizedTensor) -> torch.Tensor:
    index, signs = _lattice_fields(qt, IQ2_S_LATTICE, parity=False)
    index = index.reshape(-1, 32)
    qh = ((index >> 8).reshape(-1, 8, 4) << torch.arange(0, 8, 2)).sum(dim=-1)  # 2 high bits per group, 4 a byte
    sc = _u8(qt.aux["sc"]).reshape(-1, 8, 2)
    parts = [index & 255, signs.reshape(-1, 32), qh, _nibbles(sc[:, :, 0], sc[:, :, 1])]
    return torch.cat([_half_bytes(qt.aux["d"].reshape(-1)), *(p.to(torch.uint8) for p in parts)], dim=1)


def _iq1_fields(qt: QuantizedTensor, shift_group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """IQ1 codes (8·(g ± 1/8) + 128) -> every group of 8's point index [groups] and whether its shift is
    -1/8 [groups], in element order; refuses codes off the codebook or shifts that differ within
    `shift_group` values."""
    v = qt.codes.to(torch.int64).reshape(-1, 8) - 128
    g = torch.div(v + IQ1_CODE_STEP // 2, IQ1_CODE_STEP, rounding_mode="floor")  # v = 8g ± 1
    shift = v - IQ1_CODE_STEP * g
    index = IQ1_LATTICE.index_of_key[IQ1_LATTICE.key((g + 1).clamp(0, 2))]
    down = shift < 0
    per_shift = down.reshape(-1, shift_group)
    bad = (g.abs() > 1) | (shift.abs() != 1)
    if bool(bad.any() | (index < 0).any() | (per_shift != per_shift[:, :1]).any()):
        raise InputError(f"{qt.grid} codes that are not points of its codebook with one shift per {shift_group} values")
    return index, down[:, 0]


def pack_iq1_s(qt: QuantizedTensor) -> torch.Tensor:
    index, down = _iq1_fields(qt, 32)
    index, down = index.reshape(-1, 8, 4), down.reshape(-1, 8, 4)[:, :, 0]  # [n, sub-block, group]
    qh = ((index >> 8) << torch.arange(0, 12, 3)).sum(dim=-1) | (qt.aux["sc"].to(torch.int64).reshape(-1, 8) << 12)
    qh = qh | (down.to(torch.int64) << 15)  # uint16 per 32: 3 high bits of 4 points, the scale, the shift sign
    return torch.cat([_half_bytes(qt.aux["d"].reshape(-1)), (index & 255).reshape(-1, 32).to(torch.uint8),
                      qh.to(torch.int16).view(torch.uint8).reshape(-1, 16)], dim=1)  # fmt: skip


def pack_iq1_m(qt: QuantizedTensor) -> torch.Tensor:
    index, down = _iq1_fields(qt, 8)
    index, down = index.reshape(-1, 16, 2), down.reshape(-1, 16, 2).to(torch.int64)  # [n, sub-block of 16, group]
    qh = (index[..., 0] >> 8) | ((index[..., 1] >> 8) << 4) | (down[..., 0] << 3) | (down[..., 1] << 7)
    d_bits = qt.aux["d"].reshape(-1).to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF
    sc = (qt.aux["sc"].to(torch.int64).reshape(-1, 4, 4) << torch.arange(0, 12, 3)).sum(dim=-1)  # 4 scales a uint16
    sc = sc | (((d_bits[:, None] >> torch.arange(0, 16, 4)) & 0xF) << 12)  # and a nibble of d in the top of each
    parts = [(index & 255).reshape(-1, 32).to(torch.uint8), qh.to(torch.uint8),
             sc.to(torch.int32).to(torch.int16).view(torch.uint8).reshape(-1, 8)]  # fmt: skip
    return torch.cat(parts, dim=1)


PACKERS = {name: globals()[parts.packer] for name, parts in PARTS.items()}  # as ggml_types.PARTS names them


def pack(qt: QuantizedTensor) -> np.ndarray:
    """The tensor's bytes as a uint8 array [rows, row_bytes], ready for the GGUF writer."""
    packer = PACKERS.get(qt.grid or "")
    if packer is None:
        raise InputError(f"cannot write a {qt.grid} QuantizedTensor to GGUF (no block packer)")
    rows = qt.shape[0]
    return packer(qt).reshape(rows, -1).numpy()
