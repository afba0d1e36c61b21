"""What a quantization method is to the pipeline: a typed config, a per-stage call, a provenance.

The pipeline (pipeline.py) walks the family's stage table and, for each stage, gathers whatever
statistics the method collects about the stage's input (`collector`: GPTQ's Hessian; nothing for
round-to-nearest), then hands the stage's float weights, their grids and those statistics to
`quantize_stage`. A method never sees a file, a CLI flag or a block's forward; a writer never
sees a Hessian. A new method is one module with a config dataclass (whose `build()` returns the
method) and a class with these members, named in `llmopt.quant.spec.METHODS`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from llmopt.quant.grids import Grid
from llmopt.quantized_tensor import QuantizedTensor


class Collector(Protocol):
    """Statistics of one stage's input, fed chunk by chunk (`x_fp`: the full-precision model's input)."""

    def add(self, x: torch.Tensor, x_fp: torch.Tensor | None = None) -> None: ...


@dataclass
class Quantized:
    """One linear's result and what the method reports about it."""

    tensor: QuantizedTensor
    details: dict[str, float] = field(default_factory=dict)  # e.g. GPTQ's loss and damping


class MethodConfig(Protocol):
    """The typed options every method config has; the rest are its own."""

    name: str  # the method's name ("rtn", "gptq")
    bits: int
    group_size: int
    sym: bool
    mse: bool

    def grid(self) -> Grid:
        """The integer grid these options describe (GGUF grids are chosen per module instead)."""

    def build(self) -> Method: ...


class Method(Protocol):
    name: str
    calibrated: bool  # needs calibration tokens and a forward pass
    full_precision_inputs: bool  # wants each stage's input in the unquantized model too (GPTAQ)

    def collector(self, features: int, device: torch.device) -> Collector | None: ...

    def quantize_stage(self, weights: dict[str, torch.Tensor], grids: dict[str, Grid],
                       stats: Collector | None) -> dict[str, Quantized]:
        """The stage's linears (HF module name -> float32 weight [out, in]) quantized onto their grids."""

    def provenance(self) -> dict[str, Any]: ...
