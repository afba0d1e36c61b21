"""`quantize`: a model's linears quantized layer by layer (RTN or GPTQ), written as a checkpoint.

The path of one `llmopt quantize` through the layers: open the source (model/), build and check
the spec (quant/spec.py, with the format's rules from formats/gptq.py), load calibration samples
(calibration/), then iterate the pipeline (quant/pipeline.py) and hand each block to the writer
(formats/gptq.py), which streams it to disk.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmopt.calibration.samples import CalibConfig, load_calibration
from llmopt.calibration.text import SELF
from llmopt.device import resolve_calib_dtype, resolve_device
from llmopt.errors import OptionError
from llmopt.formats.atomic import check_output
from llmopt.formats.gptq import CheckpointWriter, check_spec, zero_min
from llmopt.formats.hf import parse_size
from llmopt.model import open_model
from llmopt.quant.pipeline import BlockResult, LayerReport, QuantizeSpec, quantize_model
from llmopt.quant.spec import build_spec, check_shapes


@dataclass
class QuantizeResult:
    output: Path
    spec: QuantizeSpec
    fmt: str
    calibration: dict[str, Any] | None
    seconds: float
    reports: list[LayerReport] = field(default_factory=list)
    block_seconds: list[tuple[int, float]] = field(default_factory=list)  # (layer, seconds); -1 is the head

    def to_dict(self) -> dict[str, Any]:
        m = self.spec.method
        return {"output": str(self.output), "format": self.fmt, "method": m.name, "bits": m.bits,
                "group_size": m.group_size, "sym": m.sym, "act_order": bool(getattr(m, "act_order", False)),
                "calibration": self.calibration, "seconds": round(self.seconds, 2),
                "layers": [layer_row(r) for r in self.reports],
                "blocks": [{"layer": layer, "seconds": round(s, 3)} for layer, s in self.block_seconds]}  # fmt: skip


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
    sym: bool = True,
    act_order: bool = False,
    group_aware: bool | None = None,
    static_groups: bool = False,
    damp: float = 0.01,
    mse: bool = False,
    refit_scales: bool = False,
    gptaq: float = 0.0,
    calib: str | None = None,
    calib_field: str | None = None,
    nsamples: int = 128,
    seqlen: int = 512,
    seed: int = 0,
    calib_dtype: str = "auto",
    fmt: str = "gptq",
    quantize_head: bool = False,
    batch_size: int = 8,
    max_shard_size: str = "5GB",
    force: bool = False,
    device: str = "auto",
    on_block: Callable[[BlockResult, int], None] | None = None,
    on_calibration: Callable[[int, int], None] | None = None,
) -> QuantizeResult:
    """Quantize `model` (an HF directory, GGUF file or hub id) and write it to `output`.

    `method` is "gptq" (calibrated) or "rtn" (no data); `fmt` "gptq" (a packed checkpoint that
    transformers, vLLM and GPTQModel load) or "dense" (dequantized float16). Calibration text is
    `calib` (a .txt/.jsonl/.parquet file, a preset, or "self": written by the model, the default).
    `on_block(result, blocks)` sees each block's result as it is written (`blocks`: how many there
    are, the head included); `on_calibration(done, total)` follows the generation of self-written
    samples.
    """
    dev = resolve_device(device)
    shard_bytes = parse_size(max_shard_size)
    check_output(Path(output), force, directory=True)
    calibrated = method != "rtn"
    if not calibrated and calib_dtype != "auto":
        raise OptionError("<calib_dtype> applies to <method> gptq; rtn runs no calibration forward")
    if not calibrated and calib is not None:
        raise OptionError("<calib> applies to <method> gptq; rtn needs no data")
    spec = build_spec(method, bits, group_size, sym, act_order=act_order, static_groups=static_groups, damp=damp,
                      mse=mse, refit_scales=refit_scales, gptaq=gptaq, group_aware=group_aware,
                      quantize_head=quantize_head, batch_size=batch_size, act_dtype=resolve_calib_dtype(calib_dtype, dev),
                      zero_min=zero_min(fmt, sym))  # fmt: skip
    check_spec(spec, fmt)
    start = time.perf_counter()
    with open_model(model) as source:
        check_shapes(source, spec)
        tokens, calib_info = None, None
        if calibrated:
            cfg = CalibConfig(calib or SELF, calib_field, nsamples, seqlen, seed)
            tokens, calib_info = load_calibration(source, cfg, dev, spec.act_dtype, on_calibration)
        built = spec.method.build()
        provenance: dict[str, Any] = {"method": built.name, "calibration": calib_info}
        if built.calibrated:
            provenance[built.name] = {**built.provenance(), "calib_dtype": str(spec.act_dtype).removeprefix("torch.")}
        result = QuantizeResult(Path(output), spec, fmt, calib_info, 0.0)
        blocks = source.arch.num_layers + (1 if quantize_head else 0)
        with CheckpointWriter(source, spec, Path(output), fmt, provenance, force, shard_bytes) as writer:
            for block in quantize_model(source, spec, tokens, dev):
                writer.add(block)
                result.reports.extend(block.reports)
                result.block_seconds.append((block.layer, block.seconds))
                if on_block is not None:
                    on_block(block, blocks)
            result.output = writer.finish()
    result.seconds = time.perf_counter() - start
    return result
