"""Automatic per-module bits for GPTQ and compressed-tensors checkpoints: the least predicted KL at a
target bits/weight.

The GGUF automatic mix (`plan/gguf_automix.py`) for the integer grid: each stage of linears
that read one input (q/k/v, gate/up, o, down: the family's stage table) takes one (bits, group
size) among `CANDIDATES` that the format holds, so that the projections vLLM fuses into one kernel share it. A module's
cost is the KL its rounding adds (Fisher-predicted, `llmopt.plan.fisher`, rounded to nearest
on that grid); bytes are what the format's layout stores for it (GPTQ: qweight, qzeros, scales, g_idx).
Bits per weight count those bytes over the quantized linears' weights. The choice is written as
GPTQModel's `dynamic` overrides (`formats/gptq.py`), which GPTQModel and vLLM apply per module, or as
compressed-tensors config groups (`formats/compressed_tensors.py`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from llmopt.calibration.samples import CalibConfig, load_calibration
from llmopt.errors import OptionError
from llmopt.formats.checkpoint import Layout, layout
from llmopt.model.source import ModelSource
from llmopt.plan.allocate import Option, allocate
from llmopt.plan.sensitivity import cache_key, load, measure, save
from llmopt.quant.pipeline import HEAD, QuantizeSpec, head_weight_name, module_name

# (bits, group size) a stage may take; the kernels vLLM and GPTQModel ship cover these.
CANDIDATES: tuple[tuple[int, int], ...] = ((2, 64), (3, 128), (3, 64), (4, 128), (4, 64), (4, 32), (8, 128))
ESTIMATOR = "fisher-diagonal/1"


def option_name(bits: int, group_size: int) -> str:
    return f"{bits}g{group_size}"


def module_nbytes(out_f: int, in_f: int, bits: int, group_size: int, fmt: Layout | None = None,
                  spec: QuantizeSpec | None = None) -> int:  # fmt: skip
    """Bytes of one linear in a checkpoint of `fmt` (default: GPTQ)."""
    parts = (fmt or layout("gptq")).parts(out_f, in_f, bits, group_size, spec=spec)
    return sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in parts)


def _holds(fmt: Layout, out_f: int, in_f: int, bits: int, group_size: int, spec: QuantizeSpec) -> bool:
    """Whether a checkpoint of `fmt` stores this linear with (bits, group_size): its widths, and whole groups
    where it needs them (compressed-tensors)."""
    if bits not in fmt.bits:
        return False
    try:
        fmt.parts(out_f, in_f, bits, group_size, spec=spec)
    except OptionError:
        return False
    return True


@dataclass
class BitsMix:
    dynamic: dict[str, tuple[int, int]]  # module -> (bits, group size), where it differs from the base
    bits_per_weight: float  # of the quantized linears, as chosen
    predicted_kld: float
    counts: dict[str, int]  # option name -> modules
    cached: bool
    seconds: float

    def to_dict(self) -> dict:
        return {"bits_per_weight": round(self.bits_per_weight, 4), "predicted_kld": self.predicted_kld,
                "modules": self.counts, "overrides": len(self.dynamic), "cached": self.cached,
                "seconds": round(self.seconds, 3)}  # fmt: skip


def plan_bits(source: ModelSource, spec: QuantizeSpec, target_bpw: float, calib: CalibConfig, *,
              fmt: str = "gptq", cache: Path | None = None, device: torch.device | str = "cpu",
              on_step: Callable[[str, int, int], None] | None = None) -> BitsMix:  # fmt: skip
    """Per-module (bits, group size) of least predicted KL whose bytes in a `fmt` checkpoint fit `target_bpw`."""
    base = (spec.method.bits, spec.method.group_size)
    stages = _stages(source, spec)
    shapes = {m: _shape(source, m) for stage in stages for m in stage}
    held = layout(fmt)
    options = {m: [c for c in CANDIDATES if c[1] <= shapes[m][1] and _holds(held, *shapes[m], *c, spec)] for m in shapes}

    def size(out_f: int, in_f: int, bits: int, group_size: int) -> int:
        return module_nbytes(out_f, in_f, bits, group_size, held, spec)

    weights = sum(o * i for o, i in shapes.values())
    items = []
    budget = int(target_bpw * weights / 8)
    least = sum(min(size(*shapes[m], *c) for c in options[m]) for m in shapes)
    if budget < least:
        raise OptionError(f"<target_bpw> {target_bpw}: the fewest bits this model's linears take is "
                          f"{8 * least / weights:.3f} bits/weight")  # fmt: skip
    names = {m: head_weight_name(source) if m == HEAD else f"{m}.weight" for m in shapes}
    grid = spec.method.grid()
    key = cache_key(source, {**calib.__dict__, "sym": spec.method.sym, "zero_min": getattr(grid, "zero_min", 0),
                                    "sym_scale": getattr(grid, "sym_scale", "gptq")},
                    names, [option_name(*c) for c in CANDIDATES if c[0] in held.bits], ESTIMATOR)  # fmt: skip
    start = time.perf_counter()
    sens = load(cache, key)
    cached = sens is not None
    if sens is None:
        def rounded(option: str, weight: torch.Tensor, _importance: torch.Tensor | None) -> torch.Tensor:
            bits, group_size = (int(x) for x in option.split("g"))
            return dataclasses.replace(grid, bits=bits, group_size=group_size).quantize(weight).dequantize()

        samples, _ = load_calibration(source, calib, device)
        sens = measure(source, names, {m: [option_name(*c) for c in options[m]] for m in shapes}, rounded, samples,
                       seed=calib.seed, key=key, device=device, on_step=on_step)  # fmt: skip
        if cache is not None:
            sens.importance = {}  # the integer grid weighs nothing by it: keep the cache small
            save(sens, cache)
    for stage in stages:  # one option for the whole stage, available to every member
        shared = [c for c in options[stage[0]] if all(c in options[m] for m in stage)]
        items.append([Option(option_name(*c), sum(size(*shapes[m], *c) for m in stage),
                             sum(sens.cost[m][sens.options[m].index(option_name(*c))] for m in stage))
                      for c in shared])  # fmt: skip
    result = allocate(items, budget)
    chosen: dict[str, tuple[int, int]] = {}
    counts: dict[str, int] = {}
    for stage, options_of, k in zip(stages, items, result.choice):
        bits, group_size = (int(x) for x in options_of[k].name.split("g"))
        for m in stage:
            counts[options_of[k].name] = counts.get(options_of[k].name, 0) + 1
            if (bits, group_size) != base:
                chosen[m] = (bits, group_size)
    return BitsMix(chosen, 8 * result.nbytes / weights, result.cost, counts, cached,
                   0.0 if cached else time.perf_counter() - start)  # fmt: skip


def _stages(source: ModelSource, spec: QuantizeSpec) -> list[list[str]]:
    family = source.arch.family
    stages = [[module_name(i, lin) for lin in stage.linears] for i in range(source.arch.num_layers)
              for stage in family.stages]  # fmt: skip
    return stages + ([[HEAD]] if spec.quantize_head else [])


def _shape(source: ModelSource, module: str) -> tuple[int, int]:
    name = head_weight_name(source) if module == HEAD else f"{module}.weight"
    out_f, in_f = (int(d) for d in source.tensors[name].shape)
    return out_f, in_f
