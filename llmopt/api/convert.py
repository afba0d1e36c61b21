"""`convert_to_hf` and `convert_to_gguf`: rewrite a model in another format, tensor by tensor.

GGUF output quantizes as llama-quantize does (same per-tensor types, same bytes), optionally
weighted by an importance matrix; `plan_gguf_file` is the dry run (types and exact size).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from llmopt.api.budget import check_memory, dry_run, pipeline_workload, sensitivity_workload
from llmopt.api.quantize import QuantizeResult, calibrate, calibration_config, feed, kept_for_resume, layer_row, provenance, resume_log
from llmopt.calibration.samples import CalibConfig
from llmopt.device import resolve_calib_dtype, resolve_device
from llmopt.errors import OptionError
from llmopt.formats.atomic import check_output
from llmopt.plan.gguf_automix import AutoMix, plan_automatic
from llmopt.formats.gguf.writer import GGUFWriter, GgufPlan, PlannedTensor, Provenance, grids_for, plan_gguf, write_gguf
from llmopt.formats.hf import output_bytes, parse_size, write_hf_dir
from llmopt.formats.imatrix import read_imatrix
from llmopt.plan.sensitivity import cache_path
from llmopt.model import ModelSource, open_model
from llmopt.quant.grids import GRIDS
from llmopt.options import GgufOptions, HfOptions, QuantizeOptions, RoundingOptions
from llmopt.quant.pipeline import BlockResult, QuantizeSpec, quantized_modules
from llmopt.quant.spec import build_spec, default_sym
from llmopt.plan.footprint import Workload


def convert_to_hf(model: str | Path, output: str | Path, options: HfOptions | None = None, *, force: bool = False,
                  on_start: Callable[[int], None] | None = None, on_tensor: Callable[[str, int], None] | None = None,
                  **kwargs: Any) -> dict[str, Any]:  # fmt: skip
    """Write `model` (GGUF, HF directory or hub id) as an HF safetensors directory of `dtype` weights
    (`HfOptions`, or keywords: `dtype`, `max_shard_size`). `on_start(total_bytes)` and
    `on_tensor(name, bytes)` follow the progress."""
    o = HfOptions.merged(options, kwargs)
    dtype, max_shard_size = o.dtype, o.max_shard_size
    shard_bytes = parse_size(max_shard_size)
    start = time.perf_counter()
    with open_model(model) as source:
        total = output_bytes(source, dtype)
        count = len(source.arch.family.stored_names(source.tensors))  # as written: a fused linear is one
        if on_start is not None:
            on_start(total)
        final = write_hf_dir(source, Path(output), dtype, shard_bytes, force, on_tensor=on_tensor)
    return {"output": str(final), "format": "hf", "dtype": dtype, "tensors": count, "bytes": total,
            "seconds": round(time.perf_counter() - start, 3)}  # fmt: skip


def parse_overrides(specs: Sequence[str]) -> list[tuple[str, str]]:
    """`REGEX=TYPE` pairs (the last '=' separates, as llama-quantize splits them)."""
    pairs = []
    for spec in specs:
        pattern, sep, type_name = spec.rpartition("=")
        if not sep or not pattern or not type_name:
            raise OptionError(f"<tensor_type> {spec!r}: expected REGEX=TYPE, e.g. 'attn_v=Q8_0'")
        pairs.append((pattern, type_name.upper()))
    return pairs


@dataclasses.dataclass(frozen=True)
class GgufJob:
    """What `prepare_gguf` makes of checked options: the calibrated method's spec and calibration (with
    `method`), the automatic mix's request (with a target), the per-tensor overrides."""

    options: GgufOptions
    spec: QuantizeSpec | None
    calibration: CalibConfig | None
    target: _Target | None
    overrides: list[tuple[str, str]]


def prepare_gguf(options: GgufOptions, device: torch.device, output: str | Path | None = None) -> GgufJob:
    """Every rule between `convert --to gguf`'s options, checked before any model is read: the API, the
    CLI (through it) and a recipe's preflight all call this."""
    overrides = parse_overrides(options.tensor_types)
    target = _Target.of(options, output)
    spec = calibration = None
    if options.method is None and (options.iters or options.lr is not None or options.scale_lr is not None):
        raise OptionError("<iters>, <lr> and <scale_lr> (learned rounding) tune what a calibrated <method> rounded: give <method>")
    if options.method is not None:
        rounding = QuantizeOptions.of(**{d.name: getattr(options, d.name) for d in RoundingOptions.declared()},
                                      seed=options.seed)  # (learned rounding draws its steps with the calibration's seed)
        spec = build_spec(rounding, options.method, default_sym(options.method),
                          act_dtype=resolve_calib_dtype(options.calib_dtype, device))  # fmt: skip
        calibration = calibration_config(options, options.nsamples)
    return GgufJob(options, spec, calibration, target, overrides)


def plan_gguf_file(model: str | Path, mix: str | None = None, *, output: str | Path | None = None, device: str = "auto",
                   command: str | None = None, on_step: Callable[[str, int, int], None] | None = None,
                   options: GgufOptions | None = None, **kwargs: Any) -> tuple[GgufPlan, dict[str, Any]]:  # fmt: skip
    """The GGUF `convert_to_gguf` would write: every tensor's type and the exact file size. With a
    target, the automatic mix (measured, or read from the cache beside `output`) and its predicted KL."""
    job = prepare_gguf(_gguf_options(options, mix, kwargs), torch.device("cpu"), output)
    with open_model(model) as source:
        plan, _, summary, _ = _plan(source, job, Provenance(command), device=resolve_device(device) if job.target else "cpu",
                                    on_step=on_step)  # fmt: skip
        if _passes(job):
            summary.update(dry_run(source.arch, _passes(job)))
    return plan, summary


def _passes(job: GgufJob) -> list[Workload]:
    """The streamed passes of a GGUF conversion: the automatic mix's Fisher pass (with a target), the
    calibrated method's pipeline (with a method); none for llama.cpp's own searches."""
    mix = [sensitivity_workload(job.target.calib)] if job.target is not None else []
    return mix + ([pipeline_workload(job.spec, job.calibration)] if job.spec is not None else [])


def convert_to_gguf(model: str | Path, output: str | Path, mix: str | None = None, *, force: bool = False,
                    command: str | None = None, name: str | None = None, imatrix_name: str | None = None,
                    device: str = "auto", on_start: Callable[[int], None] | None = None,
                    on_tensor: Callable[[PlannedTensor, float], None] | None = None,
                    on_block: Callable[[BlockResult, int], None] | None = None,
                    on_calibration: Callable[[int, int], None] | None = None,
                    on_step: Callable[[str, int, int], None] | None = None, options: GgufOptions | None = None,
                    **kwargs: Any) -> dict[str, Any]:  # fmt: skip
    """Write `model` as a GGUF file of llama.cpp type or mix `mix` (F16, Q8_0, Q4_K_M, ...).

    The options (`GgufOptions`, or the same as keywords; each with its default and range in
    llmopt/options.py): `imatrix` is an importance-matrix file (llama.cpp GGUF or .dat);
    `tensor_types` are `REGEX=TYPE` overrides and `output_tensor_type` the type of output.weight, as
    llama-quantize's --tensor-type and --output-tensor-type. With `method` ("gptq", "awq",
    "awq+gptq") the block linears are not rounded by llama.cpp's searches but by that method onto the
    same per-tensor types, calibrated on `calib` (as `quantize`); the file has exactly the types and
    size of the mix (with an imatrix: a calibrated method is an importance-weighted quantization).
    With `target_size` (bytes, or "95MB") or `target_bpw`, every quantizable tensor takes the type of
    least predicted KL divergence that fits (the automatic mix, `llmopt.plan.gguf_automix`; its
    cost table is measured on `sensitivity_samples` calibration samples and cached beside `output`).
    `command` is recorded in the file (`llmopt.command`), `name` as `general.name` (default: the
    source's name) and `imatrix_name` as `quantize.imatrix.file` (default: `imatrix` as given).
    `on_start(total_bytes)`, `on_tensor(planned, seconds)`, `on_block(result, blocks)` and
    `on_step(stage, done, total)` follow the progress.
    """
    output = Path(output)
    check_output(output, force)
    start = time.perf_counter()
    dev = resolve_device(device)
    job = prepare_gguf(_gguf_options(options, mix, kwargs), dev, output)
    events = _Events(on_start, on_tensor, on_block, on_calibration, on_step)
    with open_model(model) as source:
        plan, auto, final, result = _write_gguf(source, output, job, Provenance(command, name, imatrix_file=imatrix_name),
                                                dev, events)  # fmt: skip
    o = job.options
    summary = {"output": str(final), "format": "gguf", "type": plan.mix, "tensors": len(plan.tensors),
               "bytes": final.stat().st_size, "types": plan.types_count(), "imatrix": str(o.imatrix) if o.imatrix else None,
               "method": o.method, "seconds": round(time.perf_counter() - start, 3)}  # fmt: skip
    if auto is not None:
        summary["automix"] = _automix_summary(auto)
    if result is not None:
        summary["calibration"] = result.calibration
        summary["layers"] = [layer_row(r) for r in result.reports]
        summary["resumed_blocks"] = result.resumed_blocks
    return summary


@dataclasses.dataclass(frozen=True)
class _Events:
    on_start: Callable[[int], None] | None
    on_tensor: Callable[[PlannedTensor, float], None] | None
    on_block: Callable[[BlockResult, int], None] | None
    on_calibration: Callable[[int, int], None] | None
    on_step: Callable[[str, int, int], None] | None


def _gguf_options(options: GgufOptions | None, mix: str | None, kwargs: dict[str, Any]) -> GgufOptions:
    return GgufOptions.merged(options, {**kwargs, **({"mix": mix} if mix is not None else {})})


def _write_gguf(source: ModelSource, output: Path, job: GgufJob, prov: Provenance, dev: torch.device,
                events: _Events):  # noqa: ANN202
    """Plan and write (with a method: calibrate, then the pipeline's blocks through the writer)."""
    o, spec = job.options, job.spec
    check_memory(source.arch, _passes(job))
    tokens = calib_info = None
    if spec is not None:
        if job.target is None:
            plan, _, _, _ = _plan(source, job, prov, calibrated=True)
            if not any(t.type_name in GRIDS for t in plan.tensors):
                raise OptionError(f"<method> {o.method} rounds onto quantized types; {plan.mix} has none")
        tokens, calib_info = calibrate(source, spec, job.calibration, dev, events.on_calibration)
        prov.extra["llmopt.method"] = json.dumps(provenance(spec, calib_info), sort_keys=True)
    plan, imat, _, auto = _plan(source, job, prov, spec is not None, dev, events.on_step)
    if events.on_start is not None:
        events.on_start(plan.data_nbytes)
    importance = auto.importance if auto is not None else None if imat is None else imat.importance()
    if spec is None:
        return plan, auto, write_gguf(source, output, plan, importance=importance, force=True, on_tensor=events.on_tensor), None
    spec = dataclasses.replace(spec, grids=grids_for(plan))
    result = QuantizeResult(output, spec, "gguf", calib_info, 0.0)
    log = resume_log(source, spec, tokens, dev, output, o.resume)
    with kept_for_resume(log), GGUFWriter(source, output, plan, importance=importance,
                                          computed=quantized_modules(source, spec), force=True,
                                          on_tensor=events.on_tensor) as writer:  # fmt: skip
        feed(source, spec, tokens, dev, writer, result, events.on_block, log)
        final = writer.finish()
    return plan, auto, final, result


@dataclasses.dataclass(frozen=True)
class _Target:
    """An automatic-mix request: the size to fit, the calibration its cost table is measured on, its cache."""

    size: int | None
    bpw: float | None
    calib: CalibConfig
    cache: Path | None

    @staticmethod
    def of(o: GgufOptions, output: str | Path | None) -> _Target | None:
        if o.target_size is None and o.target_bpw is None:
            return None
        if o.target_size is not None and o.target_bpw is not None:
            raise OptionError("<target_size> and <target_bpw> are two ways to say one thing: give one")
        size = o.target_size
        nbytes = parse_size(size, "target_size") if isinstance(size, str) else size
        cache = None if output is None else cache_path(Path(output).expanduser().resolve())
        return _Target(nbytes, o.target_bpw, calibration_config(o, o.sensitivity_samples), cache)


def _plan(source: ModelSource, job: GgufJob, prov: Provenance, calibrated: bool = False,
          device: torch.device | str = "cpu", on_step: Callable[[str, int, int], None] | None = None):  # noqa: ANN202
    o, target = job.options, job.target
    imatrix = o.imatrix
    imat = read_imatrix(Path(imatrix)) if imatrix is not None else None
    prov = dataclasses.replace(prov, extra=dict(prov.extra))
    if imat is not None:
        prov.imatrix_file = prov.imatrix_file or str(imatrix)
        prov.imatrix_datasets = imat.datasets
        prov.imatrix_entries = len(imat.sums)
        prov.imatrix_chunks = imat.chunk_count
    auto = None
    if target is None:
        plan = plan_gguf(source, o.mix or "F16", overrides=job.overrides, output_tensor_type=o.output_tensor_type,
                         has_imatrix=imat is not None or calibrated, provenance=prov)  # fmt: skip
    else:
        plan, auto = plan_automatic(source, o.mix, target_size=target.size, target_bpw=target.bpw, calib=target.calib,
                                    overrides=job.overrides, output_tensor_type=o.output_tensor_type, provenance=prov,
                                    importance=None if imat is None else imat.importance(),
                                    importance_file=None if imatrix is None else str(imatrix), cache=target.cache,
                                    device=device, on_step=on_step)  # fmt: skip
    params = sum(_numel(t.shape) for t in plan.tensors)
    summary = {"type": plan.mix,
               "tensors": [{"tensor": t.gguf_name, "shape": list(t.shape), "type": t.type_name, "bytes": t.nbytes}
                           for t in plan.tensors],
               "types": plan.types_count(), "data_bytes": plan.data_nbytes, "file_bytes": plan.file_nbytes,
               "bits_per_weight": round(8 * plan.data_nbytes / params, 4)}  # fmt: skip
    if auto is not None:
        summary["automix"] = _automix_summary(auto)
    return plan, imat, summary, auto


def _automix_summary(auto: AutoMix) -> dict[str, Any]:
    return {"target_bytes": auto.target_bytes, "smallest_bytes": auto.smallest_bytes,
            "predicted_kld": auto.predicted_kld, "cached": auto.cached, "seconds": round(auto.seconds, 3)}  # fmt: skip


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
