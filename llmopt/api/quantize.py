"""`quantize`: a model's linears quantized layer by layer (RTN, GPTQ, AWQ, AWQ+GPTQ), written as a
GPTQ or AWQ checkpoint (or dense).

The path of one `llmopt quantize` through the layers: open the source (model/), build and check
the spec (quant/spec.py, with the format's rules from formats/checkpoint.py), load calibration
samples (calibration/), then iterate the pipeline (quant/pipeline.py) and hand each block to the
writer (formats/checkpoint.py), which streams it to disk.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from llmopt.api.budget import check_memory, dry_run, pipeline_workload, sensitivity_workload
from llmopt.calibration.samples import CalibConfig, load_calibration
from llmopt.calibration.text import SELF
from llmopt.device import resolve_calib_dtype, resolve_device
from llmopt.errors import OptionError
from llmopt.formats.atomic import check_output
from llmopt.formats.checkpoint import CheckpointWriter, check_spec, zero_min
from llmopt.plan.gptq_automix import BitsMix, plan_bits
from llmopt.plan.sensitivity import cache_path
from llmopt.formats.hf import parse_size
from llmopt.model import ModelSource, open_model
from llmopt.formats.resume import ResumeLog, run_key
from llmopt.quant.pipeline import BlockResult, LayerReport, QuantizeSpec, quantize_model
from llmopt.options import CalibrationOptions, QuantizeOptions
from llmopt.quant.spec import build_spec, check_shapes, default_sym
from llmopt.plan.footprint import Workload


@dataclass
class QuantizeResult:
    output: Path
    spec: QuantizeSpec
    fmt: str
    calibration: dict[str, Any] | None
    seconds: float
    reports: list[LayerReport] = field(default_factory=list)
    block_seconds: list[tuple[int, float]] = field(default_factory=list)  # (layer, seconds); -1 is the head
    automix: BitsMix | None = None  # per-module bits chosen for a target bits/weight
    resumed_blocks: int = 0  # blocks a killed run had finished (--resume), written from its progress folder

    def to_dict(self) -> dict[str, Any]:
        m = self.spec.method
        return {"output": str(self.output), "format": self.fmt, "method": m.name, "bits": m.bits,
                "group_size": m.group_size, "sym": m.sym, **({"sym_scale": m.sym_scale} if m.sym else {}),
                "act_order": bool(getattr(m, "act_order", False)),
                "calibration": self.calibration, "seconds": round(self.seconds, 2),
                "layers": [layer_row(r) for r in self.reports],
                "blocks": [{"layer": layer, "seconds": round(s, 3)} for layer, s in self.block_seconds],
                "resumed_blocks": self.resumed_blocks,
                **({"automix": self.automix.to_dict()} if self.automix is not None else {})}  # fmt: skip


def layer_row(r: LayerReport) -> dict[str, Any]:
    """One layer's report as JSON: name, shape, error metrics and the method's own numbers."""
    metrics = {k: round(v, 8) if abs(v) != float("inf") else str(v) for k, v in r.metrics.items()}
    details = {k: round(v, 6) if k.endswith("loss") else v for k, v in r.details.items()}
    return {"name": r.name, "shape": list(r.shape), **metrics, **details}


@dataclass(frozen=True)
class QuantizeJob:
    """What `prepare` makes of checked options: the method's spec, the format, the calibration."""

    options: QuantizeOptions
    spec: QuantizeSpec
    fmt: str
    calibration: CalibConfig | None  # None for a method that reads no data (rtn)
    shard_bytes: int


def prepare(options: QuantizeOptions, device: torch.device) -> QuantizeJob:
    """Every rule between `quantize`'s options, and between them and the format, checked before any
    model is read: the API, the CLI (through it) and a recipe's preflight all call this."""
    method, fmt = options.method_name, options.format_name
    calibrated = options.calibrated
    if not calibrated and options.calib_dtype != "auto":
        raise OptionError("<calib_dtype> applies to calibrated methods; rtn runs no calibration forward")
    if not calibrated and options.calib is not None:
        raise OptionError("<calib> applies to calibrated methods; rtn needs no data")
    sym = default_sym(method) if options.sym is None else options.sym
    spec = build_spec(options, method, sym, act_dtype=resolve_calib_dtype(options.calib_dtype, device),
                      zero_min=zero_min(fmt, sym))  # fmt: skip
    check_spec(spec, fmt)
    if options.scheme is not None and fmt not in ("compressed-tensors", "dense"):
        raise OptionError(f"<scheme> {options.scheme} is written as <fmt> compressed-tensors or dense, not {fmt}")
    if options.target_bpw is not None and fmt not in ("gptq", "compressed-tensors"):
        raise OptionError(f"<target_bpw> writes per-module bits (GPTQModel's `dynamic`, compressed-tensors' config groups): "
                          f"it needs <fmt> gptq or compressed-tensors, not {fmt}")  # fmt: skip
    calibration = calibration_config(options, options.nsamples) if calibrated else None
    return QuantizeJob(options, spec, fmt, calibration, parse_size(options.max_shard_size))


def passes(job: QuantizeJob) -> list[Workload]:
    """The streamed passes `quantize` runs: the automatic mix's Fisher pass (with a target), the pipeline."""
    o = job.options
    mix = [sensitivity_workload(calibration_config(o, o.sensitivity_samples))] if o.target_bpw is not None else []
    return mix + [pipeline_workload(job.spec, job.calibration)]


def plan_quantize(model: str | Path, options: QuantizeOptions | None = None, *, device: str = "auto",
                  **kwargs: Any) -> dict[str, Any]:  # fmt: skip
    """What `quantize` would do, without doing it (`--dry-run`): the method, the blocks, the calibration
    tokens, each pass's memory footprint against the memory available, and its estimated time."""
    options = QuantizeOptions.merged(options, kwargs)
    job = prepare(options, resolve_device(device))
    with open_model(model) as source:
        check_shapes(source, job.spec)
        plan = dry_run(source.arch, passes(job))
    return {"method": job.spec.method.name, "format": job.fmt, **plan}


def calibration_config(options: CalibrationOptions, nsamples: int) -> CalibConfig:
    """The calibration the options ask for, `nsamples` samples of it (the sensitivities read fewer)."""
    return CalibConfig(options.calib or SELF, options.calib_field, nsamples, options.seqlen, options.seed)


def quantize(model: str | Path, output: str | Path, options: QuantizeOptions | None = None, *, force: bool = False,
             device: str = "auto", on_block: Callable[[BlockResult, int], None] | None = None,
             on_calibration: Callable[[int, int], None] | None = None,
             on_step: Callable[[str, int, int], None] | None = None, **kwargs: Any) -> QuantizeResult:  # fmt: skip
    """Quantize `model` (an HF directory, GGUF file or hub id) and write it to `output`.

    The options (`QuantizeOptions`, or the same as keywords: `method="gptq"`, `bits=4`, ...; every one
    with its default and range in llmopt/options.py) say how: `method` "gptq", "awq", "awq+gptq"
    (calibrated) or "rtn" (no data); `fmt` "gptq" or "awq" (packed checkpoints that transformers,
    vLLM and GPTQModel load) or "dense" (dequantized float16). Calibration text is `calib` (a
    .txt/.jsonl/.parquet file, a preset, or "self": written by the model, the default).
    `target_bpw` chooses each stage's (bits, group size) for the least predicted KL divergence at
    that many bits per weight of the quantized linears (`plan/gptq_automix.py`, measured on
    `sensitivity_samples` calibration samples and cached beside `output`), written as GPTQModel's
    `dynamic` overrides; `bits`/`group_size` stay the checkpoint's defaults.
    `on_block(result, blocks)` sees each block's result as it is written (`blocks`: how many there
    are, the head included); `on_calibration(done, total)` follows the generation of self-written
    samples.
    """
    options = QuantizeOptions.merged(options, kwargs)
    dev = resolve_device(device)
    check_output(Path(output), force, directory=True)
    job = prepare(options, dev)
    start = time.perf_counter()
    with open_model(model) as source:
        spec = job.spec
        check_shapes(source, spec)
        check_memory(source.arch, passes(job))
        mix = None
        if options.target_bpw is not None:
            mix = plan_bits(source, spec, options.target_bpw, calibration_config(options, options.sensitivity_samples),
                            fmt=job.fmt, device=dev, cache=cache_path(Path(output).expanduser().resolve()), on_step=on_step)  # fmt: skip
            spec = dataclasses.replace(spec, dynamic=mix.dynamic)
            check_spec(spec, job.fmt)
        tokens, calib_info = calibrate(source, spec, job.calibration, dev, on_calibration)
        result = QuantizeResult(Path(output), spec, job.fmt, calib_info, 0.0, automix=mix)
        log = resume_log(source, spec, tokens, dev, Path(output), options.resume)
        with kept_for_resume(log), CheckpointWriter(source, spec, Path(output), job.fmt, provenance(spec, calib_info),
                                                    force, job.shard_bytes) as writer:  # fmt: skip
            feed(source, spec, tokens, dev, writer, result, on_block, log)
            result.output = writer.finish()
    result.seconds = time.perf_counter() - start
    return result


def calibrate(source: ModelSource, spec: QuantizeSpec, cfg: CalibConfig | None, device: torch.device,
              on_step: Callable[[int, int], None] | None = None) -> tuple[torch.Tensor | None, dict[str, Any] | None]:  # fmt: skip
    """The calibration tokens a calibrated method needs (None for RTN), and what to record about them."""
    if cfg is None or not spec.calibrated:
        return None, None
    return load_calibration(source, cfg, device, spec.act_dtype, on_step)


def provenance(spec: QuantizeSpec, calib_info: dict[str, Any] | None) -> dict[str, Any]:
    """What a file records about how it was quantized: the method, its options, the calibration."""
    built = spec.method.build()
    out: dict[str, Any] = {"method": built.name, "calibration": calib_info}
    if spec.method.sym:
        out["sym_scale"] = spec.method.sym_scale
    if built.calibrated:
        out[built.name] = {**built.provenance(), "calib_dtype": str(spec.act_dtype).removeprefix("torch.")}
    if spec.tune is not None:
        t = spec.tune
        out["tune"] = {"iters": t.iters, "lr": t.rate, "scale_lr": t.scale_rate, "batch_size": t.batch_size, "seed": t.seed}
    return out


def resume_log(source: ModelSource, spec: QuantizeSpec, tokens: torch.Tensor | None, device: torch.device,
               output: Path, resume: bool) -> ResumeLog | None:  # fmt: skip
    """The progress folder of a calibrated run (None without calibration tokens: nothing to resume)."""
    if tokens is None:
        return None
    return ResumeLog(output.expanduser().resolve(), run_key(source, spec, tokens, device), resume)


def kept_for_resume(log: ResumeLog | None) -> contextlib.AbstractContextManager[None]:
    """The run's progress folder is kept only for a rerun with --resume (see ResumeLog.kept_for_resume)."""
    return log.kept_for_resume() if log is not None else contextlib.nullcontext()


def feed(source: ModelSource, spec: QuantizeSpec, tokens: torch.Tensor | None, device: torch.device, writer: Any,
         result: QuantizeResult, on_block: Callable[[BlockResult, int], None] | None,
         log: ResumeLog | None = None) -> None:  # fmt: skip
    """Run the pipeline and hand every block to `writer` (a sink), keeping the reports in `result`.
    With `log`, the blocks a killed run finished go to the writer first and the pipeline goes on from
    there, recording each block it finishes."""
    blocks = source.arch.num_layers + (1 if spec.quantize_head else 0)
    done = log.finished() if log is not None else iter(())
    result.resumed_blocks = log.next if log is not None else 0
    start, record = (log.start(), log.record) if log is not None else (None, None)
    for block in itertools.chain(done, quantize_model(source, spec, tokens, device, start=start, on_progress=record)):
        writer.add(block)
        result.reports.extend(block.reports)
        result.block_seconds.append((block.layer, block.seconds))
        if on_block is not None:
            on_block(block, blocks)
