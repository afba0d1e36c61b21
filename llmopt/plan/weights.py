"""Exact weight bytes of a model under each storage format, tensor by tensor.

GGUF mixes get each tensor's type from the same llama.cpp rules the GGUF writer uses
(`llmopt.formats.gguf.mixes`), then the exact block size of that type. GPTQ and AWQ checkpoints are
sized from their packed layouts (qweight, qzeros, scales, g_idx), with every tensor they leave
unquantized (embeddings, head, norms, biases, routers) in fp16. Nothing here is params x bits / 8.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from llmopt.errors import InputError
from llmopt.formats.gguf.mixes import ShapeClasses, class_types, plan_shapes, shape_classes
from llmopt.formats.gguf.types import tensor_nbytes
from llmopt.model.arch import ArchSpec
from llmopt.plan.arch_tensors import EXPERT, LINEAR, ROUTER, PlannedTensors, linear_count, parameter_count

FP16 = 2


@dataclass(frozen=True)
class WeightFormat:
    """One storage choice: a GGUF mix, or a GPTQ/AWQ checkpoint at some bits and group size."""

    name: str
    kind: str  # "gguf", "gptq" or "awq"
    mix: str | None = None  # GGUF mix name
    bits: int | None = None  # GPTQ/AWQ bits
    group_size: int | None = None  # GPTQ/AWQ group (-1: one group per row)


def gguf_format(mix: str) -> WeightFormat:
    return WeightFormat(mix, "gguf", mix=mix)


def gptq_format(bits: int, group_size: int = 128) -> WeightFormat:
    return WeightFormat(f"GPTQ-{bits}bit-g{group_size}", "gptq", bits=bits, group_size=group_size)


def awq_format(bits: int = 4, group_size: int = 128) -> WeightFormat:
    return WeightFormat(f"AWQ-{bits}bit-g{group_size}", "awq", bits=bits, group_size=group_size)


@dataclass
class WeightSize:
    format: WeightFormat
    total_bytes: int  # every stored tensor's data
    expert_bytes: int  # the part held in MoE experts (read only partly per token)
    parameters: int
    types: dict[str, int] = field(default_factory=dict)  # storage type -> bytes (for display and checks)
    type_counts: Counter[tuple[str, tuple[int, ...]]] = field(default_factory=Counter)  # GGUF: (type, shape) -> tensors

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.total_bytes / self.parameters if self.parameters else 0.0


def weight_size(arch: ArchSpec, tensors: PlannedTensors, fmt: WeightFormat) -> WeightSize:
    if fmt.kind == "gguf":
        return gguf_weight_size(arch, tensors, fmt)
    if fmt.kind in ("gptq", "awq"):
        return packed_weight_size(tensors, fmt)
    raise InputError(f"unknown weight format kind {fmt.kind!r}")


def gguf_tensor_types(arch: ArchSpec, tensors: PlannedTensors, mix: str) -> dict[str, str]:
    """GGUF name -> GGML type under `mix`, as llama-quantize assigns them."""
    types = plan_shapes({t.gguf_name: t.shape for t in tensors}, mix, arch)
    for t in tensors:
        if t.role == ROUTER:  # llama.cpp never quantizes ffn_gate_inp (tensor_allows_quantization)
            types[t.gguf_name] = "F32"
    return types


def gguf_weight_size(arch: ArchSpec, tensors: PlannedTensors, fmt: WeightFormat) -> WeightSize:
    """Sized per llama.cpp tensor class (see `ShapeClasses`), which is what makes `recommend` fast;
    `gguf_tensor_types` is the same plan tensor by tensor."""
    classes, members = tensors.once(_gguf_classes, arch.num_layers)
    types = class_types(classes, fmt.mix or fmt.name, arch)
    size = WeightSize(fmt, 0, 0, parameter_count(tensors))
    typed: Counter[tuple[str, str, tuple[int, ...]]] = Counter()
    for (c, role, shape), n in members.items():
        typed["F32" if role == ROUTER else types[c], role, shape] += n
    for (type_name, role, shape), n in typed.items():
        size.type_counts[type_name, shape] += n
        _add(size, role, type_name, n * tensor_nbytes(type_name, shape))
    return size


def _gguf_classes(tensors: PlannedTensors, n_layers: int) -> tuple[ShapeClasses, Counter[tuple[int, str, tuple[int, ...]]]]:
    """The model's llama.cpp tensor classes, and how many tensors of each (class, role, shape) it has."""
    classes = shape_classes(tuple(t.gguf_name for t in tensors), tuple(t.shape for t in tensors), n_layers)
    return classes, Counter((c, t.role, t.shape) for c, t in zip(classes.class_of, tensors))


def gptq_linear_bytes(out_features: int, in_features: int, bits: int, group_size: int) -> dict[str, int]:
    """One GPTQ linear: qweight packed along the input dim, qzeros along the output dim, fp16
    scales per group, and g_idx (one int32 per input column)."""
    groups = _groups(in_features, group_size)
    return {
        "qweight": 4 * math.ceil(in_features * bits / 32) * out_features,
        "qzeros": 4 * groups * math.ceil(out_features * bits / 32),
        "scales": FP16 * groups * out_features,
        "g_idx": 4 * in_features,
    }


def awq_linear_bytes(out_features: int, in_features: int, bits: int, group_size: int) -> dict[str, int]:
    """One AWQ GEMM linear: qweight [in, out*bits/32] and qzeros packed along the output dim,
    fp16 scales per group; no g_idx."""
    groups = _groups(in_features, group_size)
    words_per_row = math.ceil(out_features * bits / 32)
    return {
        "qweight": 4 * in_features * words_per_row,
        "qzeros": 4 * groups * words_per_row,
        "scales": FP16 * groups * out_features,
    }


def _checkpoint_role_shapes(tensors: PlannedTensors) -> Counter[tuple[str, tuple[int, ...]]]:
    """How many tensors of each (role, shape) an HF checkpoint holds (no GGUF-only tensors)."""
    return Counter((t.role, t.shape) for t in tensors if t.hf_name is not None)


def packed_weight_size(tensors: PlannedTensors, fmt: WeightFormat) -> WeightSize:
    assert fmt.bits is not None and fmt.group_size is not None
    linear_bytes = gptq_linear_bytes if fmt.kind == "gptq" else awq_linear_bytes
    size = WeightSize(fmt, 0, 0, parameter_count(tensors))
    # GGUF-only tensors do not exist in HF checkpoints; the rest are sized once per (role, shape).
    for (role, shape), n in tensors.once(_checkpoint_role_shapes).items():
        if role in (LINEAR, EXPERT):
            nbytes = linear_count(role, shape) * sum(linear_bytes(shape[-2], shape[-1], fmt.bits, fmt.group_size).values())
            _add(size, role, f"int{fmt.bits}+fp16 scales", n * nbytes)
        else:
            _add(size, role, "F16", n * FP16 * math.prod(shape))
    return size


def _groups(in_features: int, group_size: int) -> int:
    return 1 if group_size in (-1, 0) else math.ceil(in_features / group_size)


def _add(size: WeightSize, role: str, type_name: str, nbytes: int) -> None:
    size.total_bytes += nbytes
    size.types[type_name] = size.types.get(type_name, 0) + nbytes
    if role == EXPERT:
        size.expert_bytes += nbytes
