"""The quantized-linear contract, and the registry from a weight's stored form to the module that holds it.

Every module a decoder linear becomes (a GGUF type's field module, the int4 kernel's packing, GPTQ/AWQ bit
planes, the float layouts of row_major.py, nn.Linear itself) keeps the contract `QuantizedLinear` states.
Which one a weight becomes is decided here only: `REGISTRY` maps a stored form (a GGUF type, a packed
checkpoint's method) to its candidates in order of preference, and `quantized_module` takes the first that
fits the weight, the model's dtype and the device. runtime/weights.py asks it for every linear of every
source; a form with no candidate that fits is dequantized into the dtype (the dense entry: nn.Linear).
Adding a stored form is one `register` line (and, for a new kind of module, its class).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from llmopt.model.ggml_types import GGML_TYPES_BY_ID, GGMLQuantType
from llmopt.quantized_tensor import QuantizedTensor
from llmopt.runtime import gguf_codes, gguf_lattice, group_int
from llmopt.runtime.gguf_linear import (DENSE_TYPES, NIBBLE_TYPES, F16Linear, Int8GroupLinear, IQ4Linear, KLowLinear,
                                        NibbleLinear, Q6KLinear, RawGGUFLinear, int4_parts)
from llmopt.runtime.int4 import KERNEL_DTYPE, PackedInt4Linear, kernel_shape_ok, packable

Q = GGMLQuantType
Weight = torch.Tensor | QuantizedTensor  # a GGUF weight's block bytes [out, bytes per row], or a packed layer


@runtime_checkable
class QuantizedLinear(Protocol):
    """y = x W^T (+ bias) for a weight W [out_features, in_features] held in some stored form.

    * `forward(x)`: x [..., in_features] in the model's dtype -> [..., out_features] in x's dtype; a
      batch-1 decode step's input (one row) may take a compiled product (gguf_gemv.bind_product), any other
      shape rebuilds W tile by tile (gguf_linear.tiled_linear) or calls the module's kernel.
    * `bias`: a Parameter [out_features] (the model's dtype) or None, added after the product.
    * Everything the module reads is one of its parameters or buffers, lookup tables included, so `.to()`
      moves it whole and the held bytes are their sizes (bench's decode_weight_bytes). Modules are built on
      the CPU and moved, one weight at a time, but for the int4 kernel, whose packing is the device's own.
    * Linears that read one input (q/k/v, gate/up) stack into one module of the same class where
      `gguf_linear.stacked` (field modules of one layout) or row_major's fuse (float) allows; rows stay in
      order, so the stacked output is the parts' outputs side by side.
    * Inside a compiled decode step (runtime/compiled.py) the field modules (GGUF types, bit planes) trace
      their product into the graph, the int4 kernel's op and oneDNN's (an opaque custom op) stay calls in
      it; RawGGUFLinear's rows come from numpy (such an embedding is looked up outside the graph).
    """

    in_features: int
    out_features: int
    bias: nn.Parameter | None

    def forward(self, x: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class RowSource(Protocol):
    """A module that also gives W's rows back, float32 and bit for bit the format's dequantizer: a tied
    embedding's lookup reads them (the int4 kernel's packing cannot)."""

    def rows(self, index: slice | torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class Candidate:
    """One module a stored form can become: taken where `fits(form, weight, dtype, device)`, made by
    `build(form, weight, bias, dtype, device)` on `device`; `rows`: the module is a `RowSource`."""

    build: Callable[[Hashable, Any, torch.Tensor | None, torch.dtype, torch.device], nn.Module]
    fits: Callable[[Hashable, Any, torch.dtype, torch.device], bool] = lambda *_: True
    rows: bool = True


REGISTRY: dict[Hashable, tuple[Candidate, ...]] = {}


def register(forms: Iterable[Hashable], *candidates: Candidate) -> None:
    """`candidates`, in order of preference, for each of `forms`."""
    for form in forms:
        REGISTRY[form] = candidates


def has_module(form: Hashable | None) -> bool:
    """Whether weights stored in `form` can stay in it (None: a float tensor, loaded as one)."""
    return form in REGISTRY


def quantized_module(form: Hashable, weight: Weight, bias: torch.Tensor | None, dtype: torch.dtype = torch.float32,
                     device: torch.device | None = None, rows: bool = False) -> nn.Module | None:
    """The module that holds `weight` (stored in `form`) in a `dtype` model on `device` (default: the
    weight's), or None where no candidate fits (then it is dequantized). `rows`: only a `RowSource` (a
    table read by rows, as an untied embedding)."""
    device = _device(weight) if device is None else device
    for c in REGISTRY.get(form, ()):
        if (c.rows or not rows) and c.fits(form, weight, dtype, device):
            return c.build(form, weight, bias, dtype, device)
    return None


def _device(weight: Weight) -> torch.device:
    return weight.codes.device if isinstance(weight, QuantizedTensor) else weight.device


def _field(cls: Callable[..., nn.Module], typed: bool = True) -> Candidate:
    """A module built from the bytes on the CPU, then moved (`typed`: its constructor takes the type)."""
    return Candidate(lambda q, data, bias, dtype, device: (cls(q, data, bias) if typed else cls(data, bias)).to(device))


def _gguf_int4_fits(q: GGMLQuantType, data: torch.Tensor, dtype: torch.dtype, device: torch.device) -> bool:
    """A bfloat16 model's Q4_0/Q4_1/Q4_K in a shape the int4 kernel tiles (one group per 32 inputs)."""
    _, _, block, size = GGML_TYPES_BY_ID[q]
    return dtype == KERNEL_DTYPE and kernel_shape_ok(data.shape[0], data.shape[1] // size * block, 32, device)


def _gguf_int4(q: GGMLQuantType, data: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
               device: torch.device) -> nn.Module:
    codes, scales, offsets = int4_parts(q, data)
    return PackedInt4Linear(*(t.to(device) for t in (codes, scales, offsets)), 32,
                            None if bias is None else bias.to(device))


# GGUF: the int4 kernel for a bfloat16 model's 4-bit types (see gguf_linear.py), else the type's field module
GGUF_INT4 = Candidate(_gguf_int4, _gguf_int4_fits, rows=False)
register((Q.Q4_0, Q.Q4_1, Q.Q4_K), GGUF_INT4, _field(NibbleLinear))
register((q for q in NIBBLE_TYPES if q not in REGISTRY), _field(NibbleLinear))
register((Q.Q8_0,), _field(Int8GroupLinear, typed=False))
register((Q.Q6_K,), _field(Q6KLinear, typed=False))
register((Q.Q2_K, Q.Q3_K), _field(KLowLinear))
register((Q.F16,), _field(F16Linear, typed=False))
register((Q.IQ4_NL, Q.IQ4_XS), _field(IQ4Linear))
register(gguf_lattice.TYPES, _field(gguf_lattice.LatticeLinear))
register(gguf_codes.TYPES, _field(gguf_codes.CodeLinear))
register((q for q in Q if q not in REGISTRY and q not in DENSE_TYPES), _field(RawGGUFLinear))  # any other: slow, exact

# GPTQ, AWQ and compressed-tensors (a packed checkpoint's quant_method): W = (q - z) s per group, read as a
# QuantizedTensor
register(("gptq", "awq", "compressed-tensors"),
         Candidate(lambda _, qt, bias, dtype, device: PackedInt4Linear.from_quantized(qt, bias, device),
                   lambda _, qt, dtype, device: packable(qt, device, dtype), rows=False),
         Candidate(lambda _, qt, bias, dtype, device: group_int.GroupIntLinear(qt, bias).to(device),
                   lambda _, qt, dtype, device: group_int.kept(qt)))
