"""4-bit linears kept packed, multiplied by torch's int4 weight-only kernels (CPU and CUDA).

GPTQ and AWQ dequantize as W = (q - z) * s per group. torch's int4 kernels compute W = (q - 8) * s + m
per group, so the same weights are expressed with m = (8 - z) * s (GGUF's Q4_0/Q4_1/Q4_K too, see
gguf_linear.py). s and m are held in bfloat16, so a scale is exact only where its value fits bfloat16's
8-bit mantissa (GPTQ/AWQ written by llmopt store float16 scales: not always). The kernels need plain
contiguous groups (no act-order permutation), 4 bits, and a group size they tile (32..256) that
divides the input width. They take a bfloat16 model's layers only: in a float32 model a 4-bit layer is held
as bit planes (group_int.py), whose products keep float32 math (SmolLM2 w4 g64, 2 CPU threads, 64 tokens:
the int4 kernel 53-56 tok/s with logits 1% off the dequantized model's and greedy tokens apart after 17;
bit planes 40-43 tok/s, 3e-6 off, all 64 the same). Other layers (act-order ones too) are bit planes where
they can be and dequantized otherwise.

The two devices take the same (codes, scale/offset pairs) in two packings: the CPU kernel packs int32
codes itself (`_convert_weight_to_int4pack_for_cpu`); CUDA's (tinygemm, `_convert_weight_to_int4pack`)
takes two codes a byte, the even input in the high nibble, and tiles K in `inner_k_tiles` of 16 inputs
(PyTorch's own int4 tests pack it so). The CUDA path has its shapes checked on fake CUDA tensors here
(tests/runtime/test_cuda_placement.py); its numbers come from benchmarks/runtime_cuda.py on a GPU.
"""

from __future__ import annotations

import torch
from torch import nn

from llmopt.quantized_tensor import QuantizedTensor

GROUP_SIZES = (32, 64, 128, 256)
# The CPU kernel has a fast path for bfloat16 activations only (float32 input is ~80x slower on a
# 1536x576 layer), so activations are rounded to bfloat16 on the way in; tinygemm takes bfloat16 only.
KERNEL_DTYPE = torch.bfloat16


def packable(qt: QuantizedTensor, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a layer takes the int4 kernel: in a bfloat16 model only (its activations enter as bfloat16; a
    float32 model keeps float32 math, group_int.py's bit planes, as GGUF's Q4 types do), in a shape it tiles."""
    out_f, in_f = qt.shape
    gs = qt.group_size
    return (dtype == KERNEL_DTYPE and qt.bits == 4 and qt.zeros is not None and kernel_shape_ok(out_f, in_f, gs, device)
            and qt.plain_groups())


def kernel_shape_ok(out_features: int, in_features: int, group_size: int, device: torch.device) -> bool:
    """Both kernels tile groups of 32..256 inputs (so whole tiles of 32, `inner_k_tiles`' least); the CPU's
    packs output rows 16 at a time, CUDA's 8."""
    if group_size not in GROUP_SIZES or in_features % group_size:
        return False
    if device.type == "cpu":
        return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and out_features % 16 == 0
    return device.type == "cuda" and out_features % 8 == 0


def inner_k_tiles(in_features: int) -> int:
    """tinygemm's K tiling: 8 tiles of 16 inputs where the width allows (gpt-fast's choice), else 4 or 2."""
    return next(t for t in (8, 4, 2) if in_features % (16 * t) == 0)


def cuda_int4_input(codes: torch.Tensor) -> torch.Tensor:
    """Codes [out, in] (0..15) -> what `_convert_weight_to_int4pack` takes: uint8 [out, in / 2], input 2j
    in the high nibble and 2j + 1 in the low one."""
    even, odd = codes.to(torch.uint8).reshape(codes.shape[0], -1, 2).unbind(-1)
    return (even << 4) | odd


class PackedInt4Linear(nn.Module):
    """y = x W^T (+ b) with W held as packed 4-bit codes and per-group scale/offset pairs:
    W[o, i] = (codes[o, i] - 8) * scales[o, g] + offsets[o, g], g = i // group_size. Packed for the
    device the codes are on."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None):
        super().__init__()
        dtype = KERNEL_DTYPE
        self.out_features, self.in_features = codes.shape
        self.group_size = group_size
        self.dtype = dtype
        if codes.device.type == "cpu":
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack(cuda_int4_input(codes), inner_k_tiles(codes.shape[1]))
        self.register_buffer("packed", packed)
        pairs = torch.stack([scales.to(torch.float32).t(), offsets.to(torch.float32).t()], dim=-1)  # [groups, out, 2]
        self.register_buffer("scales_and_zeros", pairs.to(dtype).contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)

    @classmethod
    def from_quantized(cls, qt: QuantizedTensor, bias: torch.Tensor | None,
                       device: torch.device | None = None) -> PackedInt4Linear:
        """GPTQ/AWQ: W = (q - z) * s, i.e. offset (8 - z) * s; packed for `device` (default: the codes')."""
        scales = qt.scales.to(device=device, dtype=torch.float32)
        offsets = (8.0 - qt.zeros.to(device=device, dtype=torch.float32)) * scales
        return cls(qt.codes.to(device), scales, offsets, qt.group_size, None if bias is None else bias.to(device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(self.dtype)
        if self.packed.device.type == "cpu":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, self.group_size, self.scales_and_zeros)
        else:
            y = torch.ops.aten._weight_int4pack_mm(flat, self.packed, self.group_size, self.scales_and_zeros)
        y = y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias.to(x.dtype)
