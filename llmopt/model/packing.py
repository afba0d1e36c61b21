"""Bit packing of integer codes into int32 words, as GPTQ ("gptq" format v1) and AWQ (GEMM)
checkpoints store them.

GPTQ: every width (2, 3, 4, 8 bits) is the same layout: the values along the packed dimension form
one little-endian bit stream, value k occupying bits [k*bits, (k+1)*bits) of it, cut into words.
For 2/4/8 bits each word holds 32/bits whole values; for 3 bits 32 values span 3 words and two of
them straddle a word boundary (AutoGPTQ's pack loop writes exactly this stream).

`qweight` packs codes along the input dimension ([in, out] -> [in*bits/32, out]); `qzeros` packs
zero points along the output dimension ([groups, out] -> [groups, out*bits/32]). Format v1 stores
zero points minus one (modulo 2**bits), a quirk of the original GPTQ CUDA kernels that every v1
reader undoes.

AWQ (4 bits only): `qweight` [in, out/8] and `qzeros` [groups, out/8] both pack along the output
dimension, eight values a word in the interleaved order 0, 2, 4, 6, 1, 3, 5, 7, and store true zero
points. This module is shared by the writers (formats/) and the readers (model/).
"""

from __future__ import annotations

import math

import torch

PACK_BITS = (2, 3, 4, 8)


def _check_bits(bits: int) -> None:
    if bits not in PACK_BITS:
        raise ValueError(f"GPTQ packing supports {PACK_BITS} bits, not {bits}")


def values_per_unit(bits: int) -> tuple[int, int]:
    """(values, words) of the smallest run that fills whole words: 8 values in 1 word at 4 bits, 32 in 3 at 3."""
    words = bits // math.gcd(32, bits)
    return 32 * words // bits, words


def packed_length(n: int, bits: int) -> int:
    """Words needed for n values (n is padded with zeros up to whole units)."""
    values, words = values_per_unit(bits)
    return -(-n // values) * words


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack [n, m] integers in [0, 2**bits) along dim 0 -> int32 [packed_length(n), m]."""
    _check_bits(bits)
    n, m = values.shape
    per, words = values_per_unit(bits)
    units = -(-n // per)
    v = torch.zeros(units * per, m, dtype=torch.int64, device=values.device)
    v[:n] = values.to(torch.int64)
    if int(v.min()) < 0 or int(v.max()) >= 1 << bits:
        raise ValueError(f"values out of range for {bits} bits")
    # bits of every value, low bit first: [units, per, bits, m] -> stream [units, per*bits, m]
    shifts = torch.arange(bits, device=v.device).view(1, 1, bits, 1)
    stream = ((v.view(units, per, 1, m) >> shifts) & 1).reshape(units, words, 32, m)
    weights = (torch.ones(32, dtype=torch.int64, device=v.device) << torch.arange(32, device=v.device)).view(1, 1, 32, 1)
    packed = (stream * weights).sum(dim=2)  # [units, words, m], in [0, 2**32)
    packed = torch.where(packed >= 1 << 31, packed - (1 << 32), packed)
    return packed.reshape(units * words, m).to(torch.int32)


def unpack_rows(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of `pack_rows`: int32 [words, m] -> int32 [n, m] values in [0, 2**bits)."""
    _check_bits(bits)
    per, words = values_per_unit(bits)
    rows, m = packed.shape
    if rows % words:
        raise ValueError(f"{rows} packed rows is not a whole number of {words}-word units")
    units = rows // words
    if n > units * per:
        raise ValueError(f"{rows} packed rows hold {units * per} values, not {n}")
    if 32 % bits == 0:  # whole values per word (2, 4, 8 bits): value i is bits i*bits.. of its word, low first
        shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device).view(1, per, 1)
        values = (packed.to(torch.int32).reshape(rows, 1, m) >> shifts) & ((1 << bits) - 1)
        return values.reshape(rows * per, m)[:n].contiguous()
    p = packed.to(torch.int64) & 0xFFFFFFFF  # values cross words (3 bits): through the bit stream
    stream = (p.view(units, words, 1, m) >> torch.arange(32, device=p.device).view(1, 1, 32, 1)) & 1
    stream = stream.reshape(units, per, bits, m)
    weights = (torch.ones(bits, dtype=torch.int64, device=p.device) << torch.arange(bits, device=p.device)).view(1, 1, bits, 1)
    values = (stream * weights).sum(dim=2).reshape(units * per, m)
    return values[:n].to(torch.int32)


def pack_qweight(codes_in_out: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes [in, out] -> qweight int32 [in*bits/32, out]."""
    return pack_rows(codes_in_out, bits)


def unpack_qweight(qweight: torch.Tensor, bits: int, in_features: int) -> torch.Tensor:
    """qweight int32 -> codes [in, out]."""
    return unpack_rows(qweight, bits, in_features)


def pack_qzeros(zeros: torch.Tensor, bits: int) -> torch.Tensor:
    """True zero points [groups, out] -> v1 qzeros int32 [groups, out*bits/32] (stored as zero - 1)."""
    stored = (zeros.to(torch.int64) - 1) % (1 << bits)
    return pack_rows(stored.t(), bits).t().contiguous()


def unpack_qzeros(qzeros: torch.Tensor, bits: int, out_features: int) -> torch.Tensor:
    """v1 qzeros -> true zero points [groups, out] in [1, 2**bits] (stored value + 1, as v1 readers do)."""
    stored = unpack_rows(qzeros.t().contiguous(), bits, out_features).t()
    return (stored.to(torch.int64) + 1).to(torch.int32).contiguous()


# AWQ's GEMM layout packs 4-bit values along the last dimension, eight to an int32, in the
# interleaved order of its kernels: nibble i of a word holds value AWQ_ORDER[i] of its eight.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """4-bit values [rows, cols] (cols a multiple of 8) -> int32 [rows, cols/8] in AWQ's order."""
    rows, cols = values.shape
    if cols % 8:
        raise ValueError(f"AWQ packs 8 values a word; {cols} is not a multiple of 8")
    v = values.to(torch.int64)
    if int(v.min()) < 0 or int(v.max()) > 15:
        raise ValueError("values out of range for 4 bits")
    groups = v.view(rows, cols // 8, 8)[:, :, list(AWQ_ORDER)]
    word = (groups << (4 * torch.arange(8, dtype=torch.int64))).sum(dim=-1)
    return torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)


def unpack_awq(packed: torch.Tensor, cols: int | None = None) -> torch.Tensor:
    """Inverse of `pack_awq`: int32 [rows, words] -> int32 [rows, cols] values in [0, 16)."""
    rows, words = packed.shape
    # value j is nibble AWQ_ORDER.index(j) of its word: shifted straight into place, no scatter
    shifts = torch.tensor([4 * AWQ_ORDER.index(j) for j in range(8)], dtype=torch.int32, device=packed.device)
    values = ((packed.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF).reshape(rows, words * 8)
    return values if cols is None else values[:, :cols].contiguous()


# FP8 E4M3 values as QuantizedTensor codes (quant/grids/fp8.py): every e4m3 value times 2^9 is an integer
# of at most 18 bits, so code = v·2^9 + 2^18 (19 bits, symmetric) with the scale divided by 2^9 keeps
# `dequantize` exact. Shared by the grid and the compressed-tensors reader, which turns float8 back into codes.
FP8_GRID = "fp8_e4m3"  # QuantizedTensor.grid of such codes
FP8_STEP = 512
FP8_CODE_BITS = 19
FP8_OFFSET = 1 << (FP8_CODE_BITS - 1)


def fp8_codes(values: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn values -> codes (int32)."""
    return (values.to(torch.float32) * FP8_STEP).to(torch.int32) + FP8_OFFSET


def fp8_values(codes: torch.Tensor) -> torch.Tensor:
    """Codes -> the float8_e4m3fn values they stand for."""
    return ((codes.to(torch.int64) - FP8_OFFSET).to(torch.float32) / FP8_STEP).to(torch.float8_e4m3fn)


# FP4 E2M1 values (MXFP4, NVFP4) as QuantizedTensor codes: the 16 values a 4-bit index stands for, doubled so
# they are integers (index bit 3 is the sign), w = (scale / 2)·FP4_VALUES[index]. Origin: llama.cpp's
# `kvalues_fp4` (ggml/src/ggml-common.h, commit 0c1e5709), the same order as compressed-tensors' E2M1 indices
# (compressors/nvfp4/helpers.py: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6, bit 3 the sign). The code of index i is
# FP4_VALUES[i] + 128 (8 bits, symmetric): (code − 128)·scale is the value. Shared by the FP4 grids
# (quant/grids/fp4.py), the GGUF packers and the compressed-tensors writer and reader.
FP4_VALUES: tuple[int, ...] = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
FP4_CODE_OFFSET = 128
FP4_CODES = torch.tensor(FP4_VALUES, dtype=torch.int32) + FP4_CODE_OFFSET  # the code of each index
FP4_LEVELS: tuple[int, ...] = tuple(sorted({v + FP4_CODE_OFFSET for v in FP4_VALUES}))  # the 15 codes, ascending
FP4_INDEX_OF_CODE = torch.zeros(256, dtype=torch.uint8)  # code -> the first index with that value (0 for ±0)
for _i in reversed(range(len(FP4_VALUES))):
    FP4_INDEX_OF_CODE[int(FP4_CODES[_i])] = _i


def pack_fp4_pairs(codes: torch.Tensor) -> torch.Tensor:
    """FP4 codes [rows, cols] (cols even) -> uint8 [rows, cols/2]: the indices of columns 2k and 2k+1 in the
    low and high nibble of byte k, compressed-tensors' `weight_packed` (pack_fp4_to_uint8)."""
    idx = FP4_INDEX_OF_CODE[codes.to(torch.int64)]
    return (idx[:, 0::2] | (idx[:, 1::2] << 4)).contiguous()


def unpack_fp4_pairs(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [rows, n] -> FP4 codes [rows, 2n] (uint8): the inverse of `pack_fp4_pairs`."""
    b = packed.to(torch.int64)
    idx = torch.stack((b & 0xF, b >> 4), dim=-1).reshape(b.shape[0], -1)
    return FP4_CODES[idx].to(torch.uint8)


def e8m0_half_scale(e: torch.Tensor) -> torch.Tensor:
    """An MXFP4 block's E8M0 byte e as the scale of its doubled FP4 values: 2^(e − 128) as float32 (denormal for
    e < 2), llama.cpp's ggml_e8m0_to_fp32_half; w = 2^(e − 127)·v, compressed-tensors' `weight_scale` byte too."""
    return torch.ldexp(torch.ones(e.shape, dtype=torch.float64), e.to(torch.float64) - 128).to(torch.float32)


NVFP4_GRID = "nvfp4_tensor_group"  # QuantizedTensor.grid of compressed-tensors' NVFP4 (quant/grids/nvfp4.py)
NVFP4_GROUP = 16


def nvfp4_scales(group_scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """The QuantizedTensor scales of NVFP4 FP4 codes: (e4m3 group scale / float32 global scale) / 2, the
    division rounded in float32 as compressed-tensors' dequantizer and vLLM do it, halved for the doubled values
    (exact)."""
    return group_scale.to(torch.float32) / global_scale.to(torch.float32).reshape(1, 1) / 2
