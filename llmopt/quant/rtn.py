"""Round-to-nearest: every group of a weight matrix rounded onto its grid on its own.

The baseline every calibration-aware method must beat, and the method that needs no data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from llmopt.quant.grids import Grid, IntGrid
from llmopt.quant.grids.integer import OnIntGrid
from llmopt.quant.method import Collector, Quantized
from llmopt.options import QuantizeOptions
from llmopt.quantized_tensor import QuantizedTensor


INPUT_ABSMAX = "input_absmax"  # QuantizedTensor.aux: the calibrated max |x| of the linear's input, [1, 1]


@dataclass(frozen=True)
class RTNConfig(OnIntGrid):
    name: ClassVar[str] = "rtn"
    bits: int = QuantizeOptions.bits
    group_size: int = QuantizeOptions.group_size  # > 0 per group, -1 per output channel, 0 one scale for the whole tensor
    sym: bool = True
    mse: bool = QuantizeOptions.mse  # clipping search per group
    zero_min: int = 0  # 1 for GPTQ v1 checkpoints (see grids/integer.py)
    sym_scale: str = "gptq"  # the symmetric grid's scale (grids/integer.py, SYM_SCALES)
    observe_inputs: bool = False  # calibrate: each linear's input range, for static activation scales (--scheme fp8, nvfp4)

    def build(self) -> RTN:
        return RTN(self)


def rtn_quantize(weight: torch.Tensor, cfg: RTNConfig) -> QuantizedTensor:
    """Quantize one weight [out, in] onto the config's integer grid."""
    return cfg.grid().quantize(weight)


class InputRange:
    """The largest |x| a stage's input takes over the calibration tokens (what a static per-tensor activation
    scale is made from, as llm-compressor's min-max observer makes it)."""

    def __init__(self, device: torch.device):
        self.absmax = torch.zeros((), dtype=torch.float32, device=device)

    def add(self, x: torch.Tensor, x_fp: torch.Tensor | None = None) -> None:
        self.absmax = torch.maximum(self.absmax, x.detach().abs().amax().to(torch.float32))


class RTN:
    name = "rtn"
    full_precision_inputs = False

    def __init__(self, config: RTNConfig):
        self.config = config
        self.calibrated = self.stage_statistics = config.observe_inputs  # a forward only to see the inputs' range

    def collector(self, features: int, device: torch.device) -> Collector | None:
        return InputRange(device) if self.config.observe_inputs else None

    def quantize_stage(self, weights: dict[str, torch.Tensor], grids: dict[str, Grid],
                       stats: Collector | None) -> dict[str, Quantized]:
        """Each linear on its own, but on a grid with a per-tensor parameter that a stage's linears share
        (`per_stage`: NVFP4's global scale, which vLLM keeps once for fused q/k/v and gate/up), the stage's
        linears on one grid as one tensor, then split by rows."""
        out: dict[str, Quantized] = {}
        shared: dict[Grid, list[str]] = {}
        for name, w in weights.items():
            if getattr(grids[name], "per_stage", False):
                shared.setdefault(grids[name], []).append(name)
            else:
                out[name] = Quantized(grids[name].quantize(w))
        for grid, names in shared.items():
            qt = grid.quantize(torch.cat([weights[n] for n in names], dim=0))
            row = 0
            for n in names:
                out[n] = Quantized(qt.take_rows(slice(row, row + weights[n].shape[0])))
                row += weights[n].shape[0]
        if isinstance(stats, InputRange):  # the stage's linears read one input: one range for them all
            for q in out.values():
                q.tensor.aux[INPUT_ABSMAX] = stats.absmax.reshape(1, 1).cpu()
        return {name: out[name] for name in weights}

    def provenance(self) -> dict[str, Any]:
        return {"mse": self.config.mse, **({"observe_inputs": True} if self.config.observe_inputs else {})}
