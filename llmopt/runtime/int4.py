"""4-bit GPTQ and AWQ linears kept packed, multiplied by torch's int4 weight-only kernel (CPU).

GPTQ and AWQ dequantize as W = (q - z) * s per group. torch's int4 kernel computes W = (q - 8) * s + m
per group, so the same weights are expressed exactly with m = (8 - z) * s. The kernel needs plain
contiguous groups (no act-order permutation), 4 bits, and a group size it tiles (32..256) that
divides the input width; other layers are dequantized instead. On CUDA the runtime dequantizes
(the CUDA kernel takes a different packing and has not been validated here).
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
    return (device.type == "cpu" and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and qt.bits == 4
            and qt.zeros is not None and gs in GROUP_SIZES and in_f % gs == 0
            and torch.equal(qt.group_index(), torch.arange(in_f) // gs))


class PackedInt4Linear(nn.Module):
    """y = x W^T (+ b) with W held as packed 4-bit codes and per-group scale/offset pairs."""

    def __init__(self, qt: QuantizedTensor, bias: torch.Tensor | None):
        super().__init__()
        dtype = KERNEL_DTYPE
        self.out_features, self.in_features = qt.shape
        self.group_size = qt.group_size
        self.dtype = dtype
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(qt.codes.to(torch.int32), 1))
        scales = qt.scales.to(torch.float32).t()  # [groups, out]
        offsets = (8.0 - qt.zeros.to(torch.float32).t()) * scales
        self.register_buffer("scales_and_zeros", torch.stack([scales, offsets], dim=-1).to(dtype).contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(self.dtype)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, self.group_size, self.scales_and_zeros)
        y = y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias.to(x.dtype)
