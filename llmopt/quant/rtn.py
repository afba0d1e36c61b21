"""Round-to-nearest: every group of a weight matrix rounded onto an integer grid on its own.

The baseline every calibration-aware method must beat, and the method that needs no data.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmopt.quant.int_grid import IntGrid, group_count
from llmopt.quant.tensor import QuantizedTensor


@dataclass(frozen=True)
class RTNConfig:
    bits: int = 4
    group_size: int = 128  # > 0 per group, -1 per output channel, 0 one scale for the whole tensor
    sym: bool = True
    mse: bool = False  # clipping search per group
    zero_min: int = 0  # 1 for GPTQ v1 checkpoints (see int_grid)

    def grid(self) -> IntGrid:
        return IntGrid(self.bits, self.sym, self.zero_min, self.mse)


def rtn_quantize(weight: torch.Tensor, cfg: RTNConfig) -> QuantizedTensor:
    """Quantize one weight [out, in]; the result dequantizes to the nearest grid point per group."""
    grid = cfg.grid()
    w = weight.to(torch.float32)
    rows, cols = w.shape
    if cfg.group_size == 0:
        scale, zero = grid.params(w.reshape(1, -1))
        codes = grid.quantize(w, scale.expand(rows), zero.expand(rows))
        return _result(codes, scale.view(1, 1), zero.view(1, 1), cfg)
    g = cols if cfg.group_size < 0 else cfg.group_size
    n = group_count(cols, cfg.group_size)
    pad = n * g - cols
    wp = torch.nn.functional.pad(w, (0, pad)) if pad else w
    groups = wp.view(rows, n, g).reshape(rows * n, g)
    if pad:  # padding columns must not widen a group's range: repeat a real value instead of 0
        groups = groups.clone().view(rows, n, g)
        groups[:, -1, g - pad:] = groups[:, -1, : 1].expand(rows, pad)
        groups = groups.view(rows * n, g)
    scale, zero = grid.params(groups)
    codes = grid.quantize(groups, scale, zero).view(rows, n * g)[:, :cols]
    return _result(codes, scale.view(rows, n), zero.view(rows, n), cfg)


def _result(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, cfg: RTNConfig) -> QuantizedTensor:
    return QuantizedTensor(codes=codes.to(torch.uint8), scales=scale, bits=cfg.bits, group_size=cfg.group_size,
                           zeros=None if cfg.sym else zero.to(torch.int32), grid="int")
