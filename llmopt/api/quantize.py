"""`quantize`: a model's linears quantized layer by layer (RTN, GPTQ, AWQ, AWQ+GPTQ), written as a
GPTQ or AWQ checkpoint (or dense).

The path of one `llmopt quantize` through the layers: open the source (model/), build and check
the spec (quant/spec.py, with the format's rules from formats/checkpoint.py), load calibration
samples (calibration/), then iterate the pipeline (quant/pipeline.py) and hand each block to the
writer (formats/checkpoint.py), which streams it to disk.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

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
from llmopt.quant.pipeline import BlockResult, LayerReport, QuantizeSpec, quantize_model
from llmopt.quant.spec import build_spec, check_shapes, default_sym


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

    def to_dict(self) -> dict[str, Any]:
        m = self.spec.method
        return {"output": str(self.output), "format": self.fmt, "method": m.name, "bits": m.bits,
                "group_size": m.group_size, "sym": m.sym, "act_order": bool(getattr(m, "act_order", False)),
                "calibration": self.calibration, "seconds": round(self.seconds, 2),
                "layers": [layer_row(r) for r in self.reports],
                "blocks": [{"layer": layer, "seconds": round(s, 3)} for layer, s in self.block_seconds],
                **({"automix": self.automix.to_dict()} if self.automix is not None else {})}  # fmt: skip


def layer_row(r: LayerReport) -> dict[str, Any]:
    """One layer's report as JSON: name, shape, error metrics and the method's own numbers."""
    metrics = {k: round(v, 8) if abs(v) != float("inf") else str(v) for k, v in r.metrics.items()}
    details = {k: round(v, 6) if k.endswith("loss") else v for k, v in r.details.items()}
    return {"name": r.name, "shape": list(r.shape), **metrics, **details}


def quantize(
    model: str | Path,
    output: str | Path,
    *,
    method: str = "gptq",
    bits: int = 4,
    group_size: int = 128,
    sym: bool | None = None,
    act_order: bool = False,
    group_aware: bool | None = None,
    static_groups: bool = False,
    damp: float = 0.01,
    mse: bool = False,
    refit_scales: bool = False,
    gptaq: float = 0.0,
    clip: bool = True,
    calib: str | None = None,
    calib_field: str | None = None,
    nsamples: int = 128,
    seqlen: int = 512,
    seed: int = 0,
    calib_dtype: str = "auto",
    fmt: str | None = None,
    target_bpw: float | None = None,
    sensitivity_samples: int = 32,
    quantize_head: bool = False,
    batch_size: int = 8,
    max_shard_size: str = "5GB",
    force: bool = False,
    device: str = "auto",
    on_block: Callable[[BlockResult, int], None] | None = None,
    on_calibration: Callable[[int, int], None] | None = None,
) -> QuantizeResult:
    """Quantize `model` (an HF directory, GGUF file or hub id) and write it to `output`.

    `method` is "gptq", "awq", "awq+gptq" (calibrated) or "rtn" (no data); `fmt` "gptq" or "awq"
    (packed checkpoints that transformers, vLLM and GPTQModel load; the method's own by default) or
    "dense" (dequantized float16). `sym=None` is the method's default (asymmetric for AWQ).
    Calibration text is `calib` (a .txt/.jsonl/.parquet file, a preset, or "self": written by the
    model, the default).
    `target_bpw` chooses each stage's (bits, group size) for the least predicted KL divergence at
    that many bits per weight of the quantized linears (`formats/gptq_automix.py`, measured on
    `sensitivity_samples` calibration samples and cached beside `output`), written as GPTQModel's
    `dynamic` overrides; `bits`/`group_size` stay the checkpoint's defaults.
    `on_block(result, blocks)` sees each block's result as it is written (`blocks`: how many there
    are, the head included); `on_calibration(done, total)` follows the generation of self-written
    samples.
    """
    dev = resolve_device(device)
    shard_bytes = parse_size(max_shard_size)
    check_output(Path(output), force, directory=True)
    calibrated = method != "rtn"
    if not calibrated and calib_dtype != "auto":
        raise OptionError("<calib_dtype> applies to calibrated methods; rtn runs no calibration forward")
    if not calibrated and calib is not None:
        raise OptionError("<calib> applies to calibrated methods; rtn needs no data")
    fmt = fmt or ("awq" if method.startswith("awq") else "gptq")
    sym = default_sym(method) if sym is None else sym
    spec = build_spec(method, bits, group_size, sym, act_order=act_order, static_groups=static_groups, damp=damp,
                      mse=mse, refit_scales=refit_scales, gptaq=gptaq, group_aware=group_aware, clip=clip,
                      quantize_head=quantize_head, batch_size=batch_size, act_dtype=resolve_calib_dtype(calib_dtype, dev),
                      zero_min=zero_min(fmt, sym))  # fmt: skip
    check_spec(spec, fmt)
    if target_bpw is not None:
        if fmt != "gptq":
            raise OptionError(f"<target_bpw> writes per-module bits as GPTQModel's `dynamic`: it needs <fmt> gptq, not {fmt}")
        if not 0 < target_bpw <= 16:
            raise OptionError(f"<target_bpw> {target_bpw}: expected bits per weight in (0, 16]")
        if sensitivity_samples < 1:
            raise OptionError(f"<sensitivity_samples> {sensitivity_samples}: must be at least 1")
    start = time.perf_counter()
    with open_model(model) as source:
        check_shapes(source, spec)
        mix = None
        if target_bpw is not None:
            sens_calib = CalibConfig(calib or SELF, calib_field, sensitivity_samples, seqlen, seed)
            mix = plan_bits(source, spec, target_bpw, sens_calib, device=dev,
                            cache=cache_path(Path(output).expanduser().resolve()))  # fmt: skip
            spec = dataclasses.replace(spec, dynamic=mix.dynamic)
            check_spec(spec, fmt)
        calibration = CalibConfig(calib or SELF, calib_field, nsamples, seqlen, seed) if calibrated else None
        tokens, calib_info = calibrate(source, spec, calibration, dev, on_calibration)
        result = QuantizeResult(Path(output), spec, fmt, calib_info, 0.0, automix=mix)
        with CheckpointWriter(source, spec, Path(output), fmt, provenance(spec, calib_info), force, shard_bytes) as writer:
            feed(source, spec, tokens, dev, writer, result, on_block)
            result.output = writer.finish()
    result.seconds = time.perf_counter() - start
    return result


def calibrate(source: ModelSource, spec: QuantizeSpec, cfg: CalibConfig | None, device: torch.device,
              on_step: Callable[[int, int], None] | None = None) -> tuple[torch.Tensor | None, dict[str, Any] | None]:  # fmt: skip
    """The calibration tokens a calibrated method needs (None for RTN), and what to record about them."""
    if cfg is None or not spec.method.build().calibrated:
        return None, None
    return load_calibration(source, cfg, device, spec.act_dtype, on_step)


def provenance(spec: QuantizeSpec, calib_info: dict[str, Any] | None) -> dict[str, Any]:
    """What a file records about how it was quantized: the method, its options, the calibration."""
    built = spec.method.build()
    out: dict[str, Any] = {"method": built.name, "calibration": calib_info}
    if built.calibrated:
        out[built.name] = {**built.provenance(), "calib_dtype": str(spec.act_dtype).removeprefix("torch.")}
    return out


def feed(source: ModelSource, spec: QuantizeSpec, tokens: torch.Tensor | None, device: torch.device, writer: Any,
         result: QuantizeResult, on_block: Callable[[BlockResult, int], None] | None) -> None:  # fmt: skip
    """Run the pipeline and hand every block to `writer` (a sink), keeping the reports in `result`."""
    blocks = source.arch.num_layers + (1 if spec.quantize_head else 0)
    for block in quantize_model(source, spec, tokens, device):
        writer.add(block)
        result.reports.extend(block.reports)
        result.block_seconds.append((block.layer, block.seconds))
        if on_block is not None:
            on_block(block, blocks)
