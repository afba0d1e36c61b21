"""4-bit linears kept packed, multiplied by torch's int4 weight-only kernel (CPU).

GPTQ and AWQ dequantize as W = (q - z) * s per group. torch's int4 kernel computes W = (q - 8) * s + m
per group, so the same weights are expressed with m = (8 - z) * s (GGUF's Q4_0/Q4_1/Q4_K too, see
gguf_linear.py). s and m are held in bfloat16, so a scale is exact only where its value fits bfloat16's
8-bit mantissa (GPTQ/AWQ written by llmopt store float16 scales: not always). The kernel needs plain
contiguous groups (no act-order permutation), 4 bits, and a group size it tiles (32..256) that
divides the input width; other layers (act-order ones too) are held as bit planes where they can be
(group_int.py) and dequantized otherwise. On CUDA the runtime dequantizes (the CUDA kernel takes a different packing and
has not been validated here).
"""

from __future__ import annotations

import torch
from torch import nn

from llmopt.quantized_tensor import QuantizedTensor

GROUP_SIZES = (32, 64, 128, 256)
# The CPU kernel has a fast path for bfloat16 activations only (float32 input is ~80x slower on a
# 1536x576 layer), so activations are rounded to bfloat16 on the way in.
KERNEL_DTYPE = torch.bfloat16


def packable(qt: QuantizedTensor, device: torch.device) -> bool:
    out_f, in_f = qt.shape
    gs = qt.group_size
    return (device.type == "cpu" and qt.bits == 4 and qt.zeros is not None and kernel_shape_ok(out_f, in_f, gs)
            and torch.equal(qt.group_index(), torch.arange(in_f) // gs))


def kernel_shape_ok(out_features: int, in_features: int, group_size: int) -> bool:
    """The CPU kernel packs output rows 16 at a time and tiles groups of 32..256 inputs."""
    return (hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and out_features % 16 == 0
            and group_size in GROUP_SIZES and in_features % group_size == 0)


class PackedInt4Linear(nn.Module):
    """y = x W^T (+ b) with W held as packed 4-bit codes and per-group scale/offset pairs:
    W[o, i] = (codes[o, i] - 8) * scales[o, g] + offsets[o, g], g = i // group_size."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None):
        super().__init__()
        dtype = KERNEL_DTYPE
        self.out_features, self.in_features = codes.shape
        self.group_size = group_size
        self.dtype = dtype
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1))
        pairs = torch.stack([scales.to(torch.float32).t(), offsets.to(torch.float32).t()], dim=-1)  # [groups, out, 2]
        self.register_buffer("scales_and_zeros", pairs.to(dtype).contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)

    @classmethod
    def from_quantized(cls, qt: QuantizedTensor, bias: torch.Tensor | None) -> PackedInt4Linear:
        """GPTQ/AWQ: W = (q - z) * s, i.e. offset (8 - z) * s."""
        scales = qt.scales.to(torch.float32)
        return cls(qt.codes, scales, (8.0 - qt.zeros.to(torch.float32)) * scales, qt.group_size, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(self.dtype)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, self.group_size, self.scales_and_zeros)
        y = y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias.to(x.dtype)
