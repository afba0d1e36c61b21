"""From checked options (api/options.py declares them) to a method's typed `QuantizeSpec`.

The rules about which method options go together live here, once, and name the options by their
field names (errors.py); each option's own type and range is checked where it is declared.
"""

from __future__ import annotations

import torch

from llmopt.errors import InputError, OptionError
from llmopt.names import CALIBRATED_SCHEMES, METHODS
from llmopt.options import QuantizeOptions
from llmopt.model.source import ModelSource
from llmopt.quant.awq import AWQConfig
from llmopt.quant.gptq import GPTQConfig
from llmopt.quant.grids.fp8 import fp8_grid
from llmopt.quant.grids.fp4 import MXFP4, mxfp4_grid
from llmopt.quant.grids.nvfp4 import NVFP4, nvfp4_grid
from llmopt.quant.pipeline import QuantizeSpec, head_weight_name
from llmopt.quant.rtn import RTNConfig
from llmopt.quant.tune import TuneConfig

# each `--scheme`'s grid for every linear, and the (bits, group size) a method config states for it
SCHEME_GRIDS = {"fp8-dynamic": (fp8_grid, 8, -1), "fp8": (fp8_grid, 8, -1), "nvfp4a16": (nvfp4_grid, 4, NVFP4.group_size),
                "nvfp4": (nvfp4_grid, 4, NVFP4.group_size), "mxfp4a16": (mxfp4_grid, 4, MXFP4.block)}  # fmt: skip
GPTQ_ONLY = "<act_order>, <group_aware>, <static_groups>, <refit_scales> and <gptaq>"


def default_sym(method: str) -> bool:
    """AWQ keeps a zero point per group (as its checkpoints do); RTN and GPTQ default to symmetric."""
    return not method.startswith("awq")


def default_sym_scale(method: str) -> str:
    """AWQ's symmetric grid is the tight one (its scales make the salient weights a group's ends, which GPTQ's
    convention leaves half a step off: off-grid SmolLM2 w4 g128 perplexity 33.32 against 34.42); RTN and GPTQ
    keep GPTQ's convention, the one GPTQModel writes."""
    return "tight" if method.startswith("awq") else "gptq"


def build_spec(o: QuantizeOptions, method: str, sym: bool, *, act_dtype: torch.dtype = torch.float32,
               zero_min: int = 0) -> QuantizeSpec:
    """The typed config of `method` from checked options. `group_aware=None` means GPTQModel's
    default: on with groups, unless act-order or static groups are asked for. `zero_min` is the
    output format's smallest storable zero point (formats.checkpoint.zero_min)."""
    if method not in METHODS:
        raise OptionError(f"<method> {method!r}: choose one of {', '.join(METHODS)}")
    gptq_rounding = method in ("gptq", "awq+gptq")
    group_aware = o.group_aware
    if group_aware is None:  # GPTQModel's default too: it costs nothing and the format is unchanged
        group_aware = gptq_rounding and o.group_size > 0 and not (o.act_order or o.static_groups)
    if not o.clip and not method.startswith("awq"):
        raise OptionError("turning off <clip> (AWQ's clipping search) applies to <method> awq and awq+gptq")
    if o.sym_scale is not None and not sym:
        raise OptionError("<sym_scale> chooses the symmetric grid's scale: it needs <sym>")
    sym_scale = o.sym_scale or default_sym_scale(method)
    common = dict(quantize_head=o.quantize_head, batch_size=o.batch_size, act_dtype=act_dtype)
    if o.iters:
        common["tune"] = TuneConfig.for_method(method, o.iters, o.lr, o.batch_size, o.seed, o.scale_lr)
    elif o.lr is not None or o.scale_lr is not None:
        step = "<lr>" if o.lr is not None else "<scale_lr>"
        raise OptionError(f"{step} is learned rounding's step size: it needs <iters> > 0")
    if o.scheme is not None:
        return _scheme_spec(o, method, common)
    if not gptq_rounding:
        if o.act_order or o.static_groups or o.refit_scales or o.gptaq or group_aware:
            raise OptionError(f"{GPTQ_ONLY} apply to <method> gptq and awq+gptq")
        if method == "rtn":
            return QuantizeSpec(RTNConfig(o.bits, o.group_size, sym, o.mse, zero_min, sym_scale), **common)
    if o.group_size == 0:
        raise OptionError(f"<group_size> 0 (per tensor) is for rtn; {method} takes -1 or a group size")
    gptq = None
    if gptq_rounding:
        if group_aware and (o.act_order or o.static_groups):
            raise OptionError("<group_aware> is an alternative to <act_order> and <static_groups>; choose one")
        gptq = GPTQConfig(o.bits, o.group_size, sym, o.act_order, o.static_groups, o.damp, o.damp_step, mse=o.mse, zero_min=zero_min, sym_scale=sym_scale,
                          refit_scales=o.refit_scales, fp_target=o.gptaq, group_aware=group_aware)  # fmt: skip
    if method == "gptq":
        config: RTNConfig | GPTQConfig | AWQConfig = gptq
    else:
        config = AWQConfig(o.bits, o.group_size, sym, o.mse, zero_min, sym_scale, clip=o.clip, gptq=gptq)
    return QuantizeSpec(config, **common)


def _scheme_spec(o: QuantizeOptions, method: str, common: dict) -> QuantizeSpec:
    """`scheme`: every linear onto one float grid (SCHEME_GRIDS): fp8-dynamic and fp8 FP8 with one scale per row,
    nvfp4a16 and nvfp4 NVFP4 (groups of 16 under a per-tensor scale), mxfp4a16 MXFP4 (groups of 32 under a power
    of two); fp8 and nvfp4 also measure each linear's input range on the calibration tokens (their static
    activation scales). Rounded to nearest, or by GPTQ's error feedback onto the same grid (`method` gptq) where
    the activations need no calibrated scale."""
    if method not in ("rtn", "gptq") or method == "gptq" and o.scheme in CALIBRATED_SCHEMES:
        raise OptionError(f"<scheme> {o.scheme} rounds to nearest{'' if o.scheme in CALIBRATED_SCHEMES else ' or by gptq'}: "
                          f"<method> {method} does not apply")  # fmt: skip
    if o.target_bpw is not None or o.mse:
        raise OptionError(f"<scheme> {o.scheme} is one grid for every linear: <target_bpw> and <mse> do not apply")
    grids, bits, group_size = SCHEME_GRIDS[o.scheme]
    if method == "gptq":
        if o.refit_scales or o.gptaq or o.group_aware:
            raise OptionError(f"<scheme> {o.scheme} with gptq takes <act_order>, <static_groups> and <damp>; "
                              f"<refit_scales>, <gptaq> and <group_aware> do not apply")  # fmt: skip
        config = GPTQConfig(bits, group_size, True, o.act_order, o.static_groups, o.damp, o.damp_step)
        return QuantizeSpec(config, grids=grids, **common)
    if o.act_order or o.static_groups or o.refit_scales or o.gptaq or o.group_aware:
        raise OptionError(f"{GPTQ_ONLY} apply to <method> gptq and awq+gptq")
    return QuantizeSpec(RTNConfig(bits, group_size, True, observe_inputs=o.scheme in CALIBRATED_SCHEMES), grids=grids,
                        **common)


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
