"""What a quantization method is to the pipeline: a typed config, a per-stage call, a provenance.

The pipeline (pipeline.py) walks the family's stage table and, for each stage, gathers whatever
statistics the method collects about the stage's input (`collector`: GPTQ's Hessian; nothing for
round-to-nearest), then hands the stage's float weights, their grids and those statistics to
`quantize_stage`. A method that changes a block before rounding it (AWQ's scales and clips) also
has `block_collector`: statistics of every stage's input in the unquantized block, handed to
`transform_block` with the block's modules. A method never sees a file, a CLI flag or a block's forward; a writer never
sees a Hessian. A new method is one module with a config dataclass (whose `build()` returns the
method) and a class with these members, named in `llmopt.quant.spec.METHODS`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from llmopt.model.families.base import Stage
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


@dataclass
class BlockAccess:
    """What a block-transforming method sees of one block: its float32 modules (changed in place),
    the family's stages with the statistics of each stage's input, and the grid of each linear."""

    layer: int
    block: nn.Module
    stages: tuple[Stage, ...]
    stats: list[Collector]  # one per stage, over the unquantized block's forward
    grids: Callable[[str], Grid]  # HF module name -> its grid
    score_linears: tuple[str, ...]  # linears whose outputs meet in attention scores (q, k)
    # producer -> block-relative modules that read its output but belong to no stage (a MoE router)
    readers: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def name(self, module: str) -> str:
        """The HF name of a block-relative module."""
        return f"model.layers.{self.layer}.{module}"

    def module(self, name: str) -> nn.Module:
        return self.block.get_submodule(name)

    def grid(self, linear: str) -> Grid:
        return self.grids(self.name(linear))


@dataclass
class BlockChanges:
    """What `transform_block` changed besides the linears it will quantize: block-relative names of
    modules whose float tensors a writer must take from the pipeline, not the source (norms, a MoE
    router, the bias of a linear that AWQ folded scales into; a quantized linear's weight is its codes)."""

    modules: set[str] = field(default_factory=set)


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
    stage_statistics: bool  # `quantize_stage` needs `collector`'s statistics of each stage's input
    full_precision_inputs: bool  # wants each stage's input in the unquantized model too (GPTAQ)

    def collector(self, features: int, device: torch.device) -> Collector | None: ...

    def quantize_stage(self, weights: dict[str, torch.Tensor], grids: dict[str, Grid],
                       stats: Collector | None) -> dict[str, Quantized]:
        """The stage's linears (HF module name -> float32 weight [out, in]) quantized onto their grids."""

    def provenance(self) -> dict[str, Any]: ...


class BlockTransform(Protocol):
    """The optional part of a method that changes a block before rounding it (AWQ)."""

    # the rounding without the change, run on the same block too; the pipeline keeps whichever leaves the
    # lower output error against the float block (awq+gptq: GPTQ alone), or None
    fallback: Method | None

    def block_collector(self, features: int, device: torch.device) -> Collector | None: ...

    def transform_block(self, block: BlockAccess) -> BlockChanges: ...
