"""Automatic mixed precision for GGUF: one type per tensor, the least predicted KL at a target size.

Every quantizable tensor may take any type its rows divide into (`candidate_types`). Its cost under
each type is the KL divergence its rounding adds, predicted from the Fisher diagonal
(`llmopt.plan.fisher`) and the tensor as llama.cpp's search (importance-weighted) rounds it;
`llmopt.plan.allocate` picks the types under the byte budget. The table of costs is what takes
time (a backward pass per sample, every tensor rounded to every type), so it is cached beside the
output (`llmopt.plan.sensitivity`).
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from llmopt.calibration.samples import CalibConfig, load_calibration
from llmopt.errors import OptionError
from llmopt.formats.gguf.mixes import CLASSIC_MIXES, DEFAULT_TYPE, allows_quantization, category, gguf_shapes, plan_shapes
from llmopt.formats.gguf.types import CANDIDATES, aligned, candidate_types, is_quantized, tensor_nbytes
from llmopt.formats.gguf.writer import GgufPlan, Provenance, plan_gguf, quantize_stored
from llmopt.model.source import ModelSource
from llmopt.plan.allocate import Allocation, Option, allocate
from llmopt.plan.sensitivity import Sensitivities, cache_key, load, measure, save

ESTIMATOR = "fisher-diagonal/1"  # bump when the cost definition changes: old caches are then ignored


def rounded(type_name: str, weight: torch.Tensor, importance: torch.Tensor | None) -> torch.Tensor:
    """`weight` as llama.cpp's search rounds it to `type_name` (weighted by `importance`), dequantized
    (an expert stack: each expert with its own importance row, as the writer rounds it)."""
    if type_name == "F16":
        return weight.to(torch.float16).to(torch.float32)
    return quantize_stored(type_name, weight, importance).dequantize().reshape(weight.shape)


def choose(shapes: Mapping[str, Sequence[int]], sens: Sensitivities, budget: int,
           alignment: int) -> tuple[dict[str, str], Allocation]:  # fmt: skip
    """The type of each tensor in `shapes` (GGUF name -> HF shape) whose padded bytes fit `budget`."""
    names = list(shapes)
    items = [[Option(t, aligned(tensor_nbytes(t, shapes[n]), alignment), c) for t, c in zip(sens.options[n], sens.cost[n])]
             for n in names]
    result = allocate(items, budget)
    return {n: items[i][k].name for i, (n, k) in enumerate(zip(names, result.choice))}, result


def smallest_nbytes(shapes: Mapping[str, Sequence[int]], alignment: int, candidates: Sequence[str] = CANDIDATES) -> int:
    """Padded bytes of the tensors in `shapes` at their smallest candidate type each."""
    return sum(min(aligned(tensor_nbytes(t, s), alignment) for t in candidate_types(s, candidates)) for s in shapes.values())


# -------------------------------------------------------------------------------------------- plan
@dataclass
class AutoMix:
    """What the automatic mix chose and why: for the summary, `--dry-run` and the file's metadata."""

    types: dict[str, str]  # GGUF name -> type, the tensors it chose for
    target_bytes: int  # the file size it had to fit
    smallest_bytes: int  # the smallest file it could have made
    predicted_kld: float  # Σ of the chosen types' predicted KL, nats per token
    importance: dict[str, torch.Tensor]  # what the writer weighs llama.cpp's searches with
    cached: bool  # the cost table came from the cache
    seconds: float  # spent on the cost table (0 when cached)


def _metadata(target: dict, predicted_kld: float, samples: int) -> str:
    """`llmopt.automix` in the file: the request as given and a fixed-width prediction, so the
    header's size is known before the choice."""
    return json.dumps({"estimator": ESTIMATOR, **target, "samples": samples,
                       "predicted_kld": f"{predicted_kld:.6e}"}, sort_keys=True)  # fmt: skip


def plan_automatic(source: ModelSource, mix: str | None, *, target_size: int | None = None,
                   target_bpw: float | None = None, calib: CalibConfig, overrides: Sequence[tuple[str, str]] = (),
                   output_tensor_type: str | None = None, provenance: Provenance | None = None,
                   importance: Mapping[str, torch.Tensor] | None = None, importance_file: str | None = None,
                   cache: Path | None = None, device: torch.device | str = "cpu",
                   on_step: Callable[[str, int, int], None] | None = None) -> tuple[GgufPlan, AutoMix]:  # fmt: skip
    """The GGUF plan whose tensors take the types of least predicted KL within `target_size` file
    bytes (or `target_bpw` bits per weight, as `--dry-run` counts them).

    Tensors a `--tensor-type` override (or `--output-tensor-type`) names keep that type; 1-D tensors
    stay F32; every other tensor is chosen for. The file is labelled `mix` (`general.file_type`), or
    with the preset nearest its size when `mix` is None.
    """
    if (target_size is None) == (target_bpw is None):
        raise OptionError("give one of <target_size> and <target_bpw>")
    provenance = provenance or Provenance()
    request = {"target_size": target_size} if target_size is not None else {"target_bpw": target_bpw}
    extra = {**provenance.extra, "llmopt.automix": _metadata(request, 0.0, calib.nsamples)}
    # The header's size does not depend on the types, only on the metadata: this plan measures it.
    base = plan_gguf(source, mix or "F16", overrides=overrides, output_tensor_type=output_tensor_type,
                     has_imatrix=True, provenance=Provenance(**{**provenance.__dict__, "extra": extra}))  # fmt: skip
    pinned = [re.compile(p) for p, _ in overrides]
    free = {t.gguf_name: t.shape for t in base.tensors
            if t.hf_name is not None and allows_quantization(t.gguf_name, t.shape)
            and not any(p.search(t.gguf_name) for p in pinned)
            and not (output_tensor_type is not None and category(t.gguf_name) == "output")}  # fmt: skip
    if not free:
        raise OptionError("every tensor's type is fixed (by <tensor_type> overrides); nothing to choose")
    fixed = sum(aligned(t.nbytes, base.alignment) for t in base.tensors if t.gguf_name not in free)
    header = aligned(base.header_nbytes, base.alignment)
    params = sum(math.prod(t.shape) for t in base.tensors)
    target = target_size if target_size is not None else header + int(target_bpw * params / 8)  # type: ignore[operator]
    least = header + fixed + smallest_nbytes(free, base.alignment)
    if target < least:
        what = f"<target_size> {target_size}" if target_size is not None else f"<target_bpw> {target_bpw}"
        raise OptionError(f"{what}: the smallest file this model makes is {least} bytes "
                          f"({least / 1e6:.2f} MB, {8 * (least - header) / params:.3f} bits/weight)")  # fmt: skip
    hf_names = {t.gguf_name: t.hf_name for t in base.tensors if t.gguf_name in free}
    key = cache_key(source, {**calib.__dict__}, hf_names, CANDIDATES, ESTIMATOR, importance_file)
    sens = load(cache, key) if cache is not None else None
    start = time.perf_counter()
    cached = sens is not None
    if sens is None:
        samples, _ = load_calibration(source, calib, device)
        options = {n: candidate_types(free[n]) for n in hf_names}
        sens = measure(source, hf_names, options, rounded, samples, seed=calib.seed, key=key, importance=importance,
                       device=device, on_step=on_step)  # fmt: skip
        if cache is not None:
            save(sens, cache)
    types, allocation = choose(free, sens, target - header - fixed, base.alignment)
    weights = dict(importance) if importance is not None else sens.importance
    auto = AutoMix(types, target, least, allocation.cost, weights, cached, 0.0 if cached else time.perf_counter() - start)
    extra["llmopt.automix"] = _metadata(request, auto.predicted_kld, calib.nsamples)
    label = mix or _nearest_preset(source, allocation.nbytes + fixed)
    final = plan_gguf(source, label, overrides=[*_exact(types), *overrides], output_tensor_type=output_tensor_type,
                      has_imatrix=True, provenance=Provenance(**{**provenance.__dict__, "extra": extra}))  # fmt: skip
    if final.file_nbytes > target:
        raise RuntimeError(f"automatic mix: planned {final.file_nbytes} bytes over the target {target}")
    return final, auto


def _exact(types: Mapping[str, str]) -> list[tuple[str, str]]:
    """`--tensor-type` overrides naming each tensor exactly."""
    return [(f"^{re.escape(name)}$", type_name) for name, type_name in types.items()]


def _nearest_preset(source: ModelSource, data_nbytes: int) -> str:
    """The quantized preset whose plain file is nearest in size (the file's `general.file_type`)."""
    shapes = gguf_shapes(source)

    def size(mix: str) -> int:
        return sum(tensor_nbytes(t, shapes[n]) for n, t in plan_shapes(shapes, mix, source.arch, has_imatrix=True).items())

    presets = [m for m in CLASSIC_MIXES if is_quantized(DEFAULT_TYPE[m])]
    return min(presets, key=lambda m: (abs(size(m) - data_nbytes), m))

