"""From flat options (what `llmopt quantize` and a recipe give) to a checked `QuantizeSpec`.

Every rule about which options go together lives here, once, and names the options by their
field names (errors.py): the CLI only parses flags and the Python API passes keywords.
"""

from __future__ import annotations

import torch

from llmopt.errors import InputError, OptionError
from llmopt.names import METHODS
from llmopt.model.source import ModelSource
from llmopt.quant.awq import AWQConfig
from llmopt.quant.gptq import GPTQConfig
from llmopt.quant.pipeline import QuantizeSpec, head_weight_name
from llmopt.quant.rtn import RTNConfig

GPTQ_ONLY = "<act_order>, <group_aware>, <static_groups>, <refit_scales> and <gptaq>"


def default_sym(method: str) -> bool:
    """AWQ keeps a zero point per group (as its checkpoints do); RTN and GPTQ default to symmetric."""
    return not method.startswith("awq")


def build_spec(method: str = "gptq", bits: int = 4, group_size: int = 128, sym: bool | None = None, *,
               act_order: bool = False, static_groups: bool = False, damp: float = 0.01, mse: bool = False,
               refit_scales: bool = False, gptaq: float = 0.0, group_aware: bool | None = None, clip: bool = True,
               quantize_head: bool = False, batch_size: int = 8, act_dtype: torch.dtype = torch.float32,
               zero_min: int = 0) -> QuantizeSpec:  # fmt: skip
    """Validate the options and turn them into the typed config of `method`. `sym=None` is the
    method's default (`default_sym`); `group_aware=None` means GPTQModel's default: on with groups,
    unless act-order or static groups are asked for. `clip` is AWQ's clipping search. `zero_min`
    is the output format's smallest storable zero point (formats.checkpoint.zero_min)."""
    if method not in METHODS:
        raise OptionError(f"<method> {method!r}: choose one of {', '.join(METHODS)}")
    if not 2 <= bits <= 8:
        raise OptionError(f"<bits> {bits}: choose 2 to 8")
    if group_size < -1:
        raise OptionError(f"<group_size> {group_size}: use a positive size, -1 (per channel) or 0 (per tensor)")
    if batch_size < 1:
        raise OptionError(f"<batch_size> {batch_size}: must be positive")
    sym = default_sym(method) if sym is None else sym
    gptq_rounding = method in ("gptq", "awq+gptq")
    if group_aware is None:  # GPTQModel's default too: it costs nothing and the format is unchanged
        group_aware = gptq_rounding and group_size > 0 and not (act_order or static_groups)
    if not clip and not method.startswith("awq"):
        raise OptionError("turning off <clip> (AWQ's clipping search) applies to <method> awq and awq+gptq")
    if not gptq_rounding:
        if act_order or static_groups or refit_scales or gptaq or group_aware:
            raise OptionError(f"{GPTQ_ONLY} apply to <method> gptq and awq+gptq")
        if method == "rtn":
            return QuantizeSpec(RTNConfig(bits, group_size, sym, mse, zero_min), quantize_head=quantize_head,
                                batch_size=batch_size, act_dtype=act_dtype)  # fmt: skip
    if group_size == 0:
        raise OptionError(f"<group_size> 0 (per tensor) is for rtn; {method} takes -1 or a group size")
    gptq = None
    if gptq_rounding:
        if not 0 <= damp < 1:
            raise OptionError(f"<damp> {damp}: choose a fraction in [0, 1)")
        if group_aware and (act_order or static_groups):
            raise OptionError("<group_aware> is an alternative to <act_order> and <static_groups>; choose one")
        if not 0 <= gptaq <= 1:
            raise OptionError(f"<gptaq> {gptaq}: choose a strength in [0, 1] (0 = off)")
        gptq = GPTQConfig(bits, group_size, sym, act_order, static_groups, damp, mse=mse, zero_min=zero_min,
                          refit_scales=refit_scales, fp_target=gptaq, group_aware=group_aware)  # fmt: skip
    if method == "gptq":
        config: RTNConfig | GPTQConfig | AWQConfig = gptq
    else:
        config = AWQConfig(bits, group_size, sym, mse, zero_min, clip=clip, gptq=gptq)
    return QuantizeSpec(config, quantize_head=quantize_head, batch_size=batch_size, act_dtype=act_dtype)


def check_shapes(source: ModelSource, spec: QuantizeSpec) -> None:
    """Every quantized linear must hold at least one whole group. A last, partial group is allowed:
    GPTQ checkpoints store ceil(in/group) groups (GPTQModel writes SmolLM2's 576 inputs at g128 so)."""
    names = [f"model.layers.0.{lin}.weight" for lin in source.arch.family.linears]
    if spec.quantize_head:
        names.append(head_weight_name(source))
    group_size = spec.method.group_size
    for name in names:
        if name not in source.tensors:
            raise InputError(f"{source.path}: no tensor {name}; not a decoder llmopt can quantize")
        in_f = source.tensors[name].shape[1]
        if group_size > in_f:
            raise OptionError(f"<group_size> {group_size} is larger than the {in_f} input features of "
                              f"{name.removesuffix('.weight').replace('model.layers.0.', '')}")  # fmt: skip
