"""What a compressed-tensors `quantization_config` says about each linear: its config group's weight scheme.

llm-compressor (and llmopt's `--format compressed-tensors`) write `config_groups`, each with `targets`
(a module name, a `re:` pattern matched with re.match, or a class name such as "Linear") and `weights`
(QuantizationArgs). A module takes the group of its most specific target, as compressed-tensors orders
them: exact name, then pattern, then class. This reader takes integer weight-only schemes stored
`pack-quantized` (W4A16, W8A16, asymmetric or not, group or channel), FP8 weights stored
`float-quantized` per channel, with activations unquantized or quantized per token at run
time (FP8_DYNAMIC; llmopt's runtime keeps activations in its own dtype, so it runs such a model as W8A16),
FP8 with static per-tensor activation scales (`input_scale`, FP8's preset), and NVFP4 weights stored
`nvfp4-pack-quantized` (FP4 in groups of 16 under e4m3 scales and a per-tensor
global scale, strategy "tensor_group"), with activations unquantized (NVFP4A16) or as NVFP4's own
(FP4 "tensor_group", dynamic "local": run in llmopt as W4A16), and MXFP4 weights stored `mxfp4-pack-quantized`
(FP4 in groups of 32 under E8M0 power-of-two scales), activations unquantized or the MXFP4 preset's dynamic
ones; anything else is one line.
Used by `CompressedTensorsDirSource` (model/quantized_dir.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from llmopt.errors import InputError
from llmopt.model.packing import NVFP4_GROUP, packed_length

MXFP4_GROUP = 32

PACKED = "pack-quantized"
FLOAT = "float-quantized"
NVFP4_PACKED = "nvfp4-pack-quantized"
MXFP4_PACKED = "mxfp4-pack-quantized"
FP4_PACKED = (NVFP4_PACKED, MXFP4_PACKED)
KINDS = {PACKED: "int", FLOAT: "float", NVFP4_PACKED: "float", MXFP4_PACKED: "float"}  # what each storage format holds
# (storage format) -> the weight schemes it holds here: (bits, strategy) -> the group size (None: any)
WEIGHTS = {PACKED: {(b, st): None for b in (2, 4, 8) for st in ("group", "channel")},
           FLOAT: {(8, "channel"): None}, NVFP4_PACKED: {(4, "tensor_group"): NVFP4_GROUP},
           MXFP4_PACKED: {(4, "group"): MXFP4_GROUP}}  # fmt: skip
BITS = (2, 4, 8)  # whole values per int32 word: compressed-tensors' packing is then ours (model/packing.py)
ACTORDERS = (None, "weight", "static", "group", "dynamic")  # group/dynamic: permuted groups, weight_g_idx


def int_part_shapes(out_f: int, in_f: int, bits: int, group_size: int) -> dict[str, tuple[int, ...]]:
    """The stored shape of every part of a pack-quantized linear [out_f, in_f] (group_size <= 0: one group per
    row): what llmopt's writer plans and what its reader checks a checkpoint against."""
    groups = -(-in_f // group_size) if group_size > 0 else 1
    return {"weight_packed": (out_f, packed_length(in_f, bits)), "weight_scale": (out_f, groups),
            "weight_zero_point": (packed_length(out_f, bits), groups), "weight_g_idx": (in_f,), "weight_shape": (2,)}  # fmt: skip


def fp4_part_shapes(out_f: int, in_f: int, group_size: int) -> dict[str, tuple[int, ...]]:
    """The stored shape of every part of an nvfp4- or mxfp4-pack-quantized linear [out_f, in_f] (in_f a multiple of
    the group size: 16 for NVFP4, whose scale is e4m3, 32 for MXFP4, whose scale is an E8M0 byte)."""
    return {"weight_packed": (out_f, in_f // 2), "weight_scale": (out_f, in_f // group_size),
            "weight_global_scale": (1,), "input_global_scale": (1,)}  # fmt: skip


@dataclass(frozen=True)
class WeightScheme:
    bits: int
    group_size: int  # > 0, or -1 per output channel
    sym: bool
    kind: str = "int"  # "float": FP8 e4m3 weights (`weight`, `weight_scale`) or NVFP4 (4 bits)
    fmt: str = PACKED  # the storage format
    static_inputs: bool = False  # a stored activation scale (`input_scale`, `input_global_scale`) per module

    @property
    def nvfp4(self) -> bool:
        return self.fmt == NVFP4_PACKED

    @property
    def fp4(self) -> bool:
        """FP4 values two a byte (NVFP4 or MXFP4)."""
        return self.fmt in FP4_PACKED


def _activations_held(fmt: str, acts: object) -> bool:
    """Whether llmopt runs a group's input activations as written (in its own dtype): none, FP8's per token
    dynamic ones, or NVFP4's own (FP4 per 16 under a calibrated global scale, dynamic "local")."""
    if not acts:
        return True
    if not isinstance(acts, dict):
        return False
    key = (acts.get("type"), acts.get("num_bits"), acts.get("strategy"), acts.get("dynamic"))
    if fmt == FLOAT:
        return key in (("float", 8, "token", True), ("float", 8, "tensor", False))
    if fmt == MXFP4_PACKED:  # the MXFP4 preset's: FP4 per 32 at run time
        return key == ("float", 4, "group", True)
    return fmt == NVFP4_PACKED and key == ("float", 4, "tensor_group", "local")


def _static_inputs(acts: object) -> bool:
    """Whether the activations' scale is stored (calibrated): FP8's static per-tensor `input_scale`, NVFP4's
    `input_global_scale` (its groups' scales are made at run time, "local", under that one)."""
    return isinstance(acts, dict) and acts.get("dynamic") in (False, "local")


@dataclass(frozen=True)
class Group:
    name: str
    targets: tuple[str, ...]
    scheme: WeightScheme


def _scheme(path: Path, name: str, group: object, top_format: object) -> WeightScheme:
    """One config group's weights, or a one-line refusal of what the runtime cannot run as written."""
    where = f"{path}: quantization_config.config_groups.{name}"
    if not isinstance(group, dict):
        raise InputError(f"{where} must be an object")
    fmt = group.get("format") or top_format
    if fmt not in KINDS:
        raise InputError(f"{where}: format {fmt!r} is not supported (llmopt reads {PACKED!r} and {FLOAT!r})")
    w = group.get("weights")
    if not isinstance(w, dict):
        raise InputError(f"{where}: no weights scheme (llmopt reads weight schemes)")
    if group.get("output_activations") or not _activations_held(fmt, group.get("input_activations")):
        raise InputError(f"{where}: quantized activations are not supported (llmopt reads weight-only schemes, "
                         f"FP8 with dynamic per-token or static per-tensor activations and NVFP4's own)")  # fmt: skip
    kind, strategy, actorder = w.get("type", "int"), w.get("strategy"), w.get("actorder")
    try:
        bits = int(w.get("num_bits", 8))
        group_size = int(w.get("group_size") or -1)
    except (TypeError, ValueError):
        raise InputError(f"{where}: bad num_bits or group_size") from None
    if strategy is None:
        strategy = "group" if group_size > 0 else "channel"
    held = WEIGHTS[fmt]
    if kind != KINDS[fmt] or (bits, strategy) not in held or held[bits, strategy] not in (None, group_size) or \
            w.get("dynamic") or actorder not in ACTORDERS or kind == "float" and not w.get("symmetric", True):  # fmt: skip
        raise InputError(f"{where}: weight scheme {kind} {bits}-bit {strategy} (group {group_size}, dynamic "
                         f"{w.get('dynamic')}, actorder {actorder}) in {fmt} is not supported (llmopt reads int "
                         f"{'/'.join(map(str, BITS))}-bit, group or channel; symmetric float 8-bit per channel; "
                         f"NVFP4: float 4-bit tensor_group, group 16; MXFP4: float 4-bit group 32; static)")  # fmt: skip
    if strategy in ("group", "tensor_group") and group_size <= 0:
        raise InputError(f"{where}: strategy {strategy} needs a positive group_size, got {group_size}")
    group_size = group_size if strategy in ("group", "tensor_group") else -1
    return WeightScheme(bits, group_size, bool(w.get("symmetric", True)), kind, fmt, _static_inputs(group.get("input_activations")))


def groups(path: Path, q: dict) -> list[Group]:
    """Every config group of a compressed checkpoint's quantization_config, checked."""
    status = q.get("quantization_status", "compressed")
    if status != "compressed":
        raise InputError(f"{path}: quantization_status {status!r} is not supported (llmopt reads 'compressed' checkpoints)")
    config_groups = q.get("config_groups")
    if not isinstance(config_groups, dict) or not config_groups:
        raise InputError(f"{path}: quantization_config.config_groups must name at least one group")
    out = []
    for name, group in config_groups.items():
        scheme = _scheme(path, name, group, q.get("format"))
        targets = group.get("targets")
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
            raise InputError(f"{path}: quantization_config.config_groups.{name}.targets must be a list of strings")
        for t in targets:
            if t.startswith("re:"):
                try:
                    re.compile(t[3:])
                except re.error as e:
                    raise InputError(f"{path}: config_groups.{name} has a bad target {t!r} ({e})") from None
        out.append(Group(name, tuple(targets), scheme))
    return out


def scheme_of(module: str, groups: list[Group], names: set[str]) -> WeightScheme | None:
    """The scheme of `module`: its group by exact name, else by `re:` pattern, else by class (any other target,
    as "Linear", that names no module of the checkpoint); None where no group targets it."""
    for exact in (True, False):
        for g in groups:
            for t in g.targets:
                if exact and t == module or not exact and t.startswith("re:") and re.match(t[3:], module):
                    return g.scheme
    for g in groups:
        if any(not t.startswith("re:") and t not in names for t in g.targets):
            return g.scheme
    return None
