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

from llmopt.api.quantize import QuantizeResult, calibrate, feed, layer_row, provenance
from llmopt.calibration.samples import CalibConfig
from llmopt.calibration.text import SELF
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
from llmopt.quant.pipeline import BlockResult, quantized_modules
from llmopt.quant.spec import METHODS, build_spec


def convert_to_hf(model: str | Path, output: str | Path, *, dtype: str = "float16", max_shard_size: str = "5GB",
                  force: bool = False, on_start: Callable[[int], None] | None = None,
                  on_tensor: Callable[[str, int], None] | None = None) -> dict[str, Any]:  # fmt: skip
    """Write `model` (GGUF, HF directory or hub id) as an HF safetensors directory of `dtype` weights.
    `on_start(total_bytes)` and `on_tensor(name, bytes)` follow the progress."""
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


def plan_gguf_file(model: str | Path, mix: str | None = None, *, imatrix: str | Path | None = None,
                   tensor_types: Sequence[str] = (), output_tensor_type: str | None = None,
                   command: str | None = None, target_size: str | int | None = None, target_bpw: float | None = None,
                   calib: str | None = None, calib_field: str | None = None, sensitivity_samples: int = 32,
                   seqlen: int = 512, seed: int = 0, output: str | Path | None = None, device: str = "auto",
                   on_step: Callable[[str, int, int], None] | None = None) -> tuple[GgufPlan, dict[str, Any]]:  # fmt: skip
    """The GGUF `convert_to_gguf` would write: every tensor's type and the exact file size. With a
    target, the automatic mix (measured, or read from the cache beside `output`) and its predicted KL."""
    target = _Target.of(target_size, target_bpw, calib, calib_field, sensitivity_samples, seqlen, seed, output)
    with open_model(model) as source:
        plan, _, summary, _ = _plan(source, mix, imatrix, tensor_types, output_tensor_type, Provenance(command), target=target,
                                    device=resolve_device(device) if target else "cpu", on_step=on_step)  # fmt: skip
    return plan, summary


def convert_to_gguf(model: str | Path, output: str | Path, mix: str | None = None, *,
                    imatrix: str | Path | None = None, tensor_types: Sequence[str] = (),
                    output_tensor_type: str | None = None, force: bool = False, command: str | None = None,
                    name: str | None = None, imatrix_name: str | None = None, method: str | None = None, target_size: str | int | None = None, target_bpw: float | None = None,
                    sensitivity_samples: int = 32, calib: str | None = None, calib_field: str | None = None,
                    nsamples: int = 128, seqlen: int = 512, seed: int = 0, calib_dtype: str = "auto",
                    damp: float = 0.01, act_order: bool = False, static_groups: bool = False,
                    group_aware: bool | None = None, gptaq: float = 0.0, clip: bool = True, batch_size: int = 8,
                    device: str = "auto", on_start: Callable[[int], None] | None = None,
                    on_tensor: Callable[[PlannedTensor, float], None] | None = None,
                    on_block: Callable[[BlockResult, int], None] | None = None,
                    on_calibration: Callable[[int, int], None] | None = None,
                    on_step: Callable[[str, int, int], None] | None = None) -> dict[str, Any]:  # fmt: skip
    """Write `model` as a GGUF file of llama.cpp type or mix `mix` (F16, Q8_0, Q4_K_M, ...).

    `imatrix` is an importance-matrix file (llama.cpp GGUF or .dat); `tensor_types` are
    `REGEX=TYPE` overrides and `output_tensor_type` the type of output.weight, as llama-quantize's
    --tensor-type and --output-tensor-type. `command` is recorded in the file (`llmopt.command`),
    `name` as `general.name` (default: the source's name) and `imatrix_name` as
    `quantize.imatrix.file` (default: `imatrix` as given).
    With `method` ("gptq", "awq", "awq+gptq") the block linears are not rounded by llama.cpp's
    searches but by that method onto the same per-tensor types, calibrated on `calib` (as
    `quantize`); the file has exactly the types and size of the mix (with an imatrix: a calibrated
    method is an importance-weighted quantization). With `target_size` (bytes, or "95MB") or
    `target_bpw`, every quantizable tensor takes the type of least predicted KL divergence that
    fits (the automatic mix, `llmopt.formats.gguf.automix`; its cost table is measured on
    `sensitivity_samples` calibration samples and cached beside `output`). `on_start(total_bytes)`,
    `on_tensor(planned, seconds)`, `on_block(result, blocks)` and `on_step(stage, done, total)`
    follow the progress.
    """
    output = Path(output)
    check_output(output, force)
    start = time.perf_counter()
    if method is not None and method not in METHODS or method == "rtn":
        raise OptionError(f"<method> {method!r}: GGUF files take gptq, awq or awq+gptq (or none: llama.cpp's rounding)")
    target = _Target.of(target_size, target_bpw, calib, calib_field, sensitivity_samples, seqlen, seed, output)
    dev = resolve_device(device)
    with open_model(model) as source:
        extra: dict[str, str] = {}
        spec = tokens = calib_info = None
        if method is not None:
            if target is None:
                plan, _, _, _ = _plan(source, mix, imatrix, tensor_types, output_tensor_type, Provenance(command, name), True)
                if not any(t.type_name in GRIDS for t in plan.tensors):
                    raise OptionError(f"<method> {method} rounds onto quantized types; {plan.mix} has none")
            spec = build_spec(method, act_order=act_order, static_groups=static_groups, damp=damp, gptaq=gptaq,
                              group_aware=group_aware, clip=clip, batch_size=batch_size,
                              act_dtype=resolve_calib_dtype(calib_dtype, dev))  # fmt: skip
            cfg = CalibConfig(calib or SELF, calib_field, nsamples, seqlen, seed)
            tokens, calib_info = calibrate(source, spec, cfg, dev, on_calibration)
            extra["llmopt.method"] = json.dumps(provenance(spec, calib_info), sort_keys=True)
        prov = Provenance(command, name, imatrix_file=imatrix_name, extra=extra)
        plan, imat, _, auto = _plan(source, mix, imatrix, tensor_types, output_tensor_type, prov,
                                    method is not None, target, dev, on_step)  # fmt: skip
        if on_start is not None:
            on_start(plan.data_nbytes)
        importance = auto.importance if auto is not None else None if imat is None else imat.importance()
        result = None
        if spec is None:
            final = write_gguf(source, output, plan, importance=importance, force=True, on_tensor=on_tensor)
        else:
            spec = dataclasses.replace(spec, grids=grids_for(plan))
            result = QuantizeResult(output, spec, "gguf", calib_info, 0.0)
            with GGUFWriter(source, output, plan, importance=importance, computed=quantized_modules(source, spec),
                            force=True, on_tensor=on_tensor) as writer:  # fmt: skip
                feed(source, spec, tokens, dev, writer, result, on_block)
                final = writer.finish()
    summary = {"output": str(final), "format": "gguf", "type": plan.mix, "tensors": len(plan.tensors),
               "bytes": final.stat().st_size, "types": plan.types_count(), "imatrix": str(imatrix) if imatrix else None,
               "method": method, "seconds": round(time.perf_counter() - start, 3)}  # fmt: skip
    if auto is not None:
        summary["automix"] = _automix_summary(auto)
    if result is not None:
        summary["calibration"] = result.calibration
        summary["layers"] = [layer_row(r) for r in result.reports]
    return summary


@dataclasses.dataclass(frozen=True)
class _Target:
    """An automatic-mix request: the size to fit, the calibration its cost table is measured on, its cache."""

    size: int | None
    bpw: float | None
    calib: CalibConfig
    cache: Path | None

    @staticmethod
    def of(size: str | int | None, bpw: float | None, calib: str | None, calib_field: str | None, samples: int,
           seqlen: int, seed: int, output: str | Path | None) -> _Target | None:  # fmt: skip
        if size is None and bpw is None:
            return None
        if size is not None and bpw is not None:
            raise OptionError("<target_size> and <target_bpw> are two ways to say one thing: give one")
        if bpw is not None and not 0 < bpw <= 32:
            raise OptionError(f"<target_bpw> {bpw}: expected bits per weight in (0, 32]")
        if samples < 1:
            raise OptionError(f"<sensitivity_samples> {samples}: must be at least 1")
        nbytes = parse_size(size, "target_size") if isinstance(size, str) else size
        cache = None if output is None else cache_path(Path(output).expanduser().resolve())
        return _Target(nbytes, bpw, CalibConfig(calib or SELF, calib_field, samples, seqlen, seed), cache)


def _plan(source: ModelSource, mix: str | None, imatrix: str | Path | None, tensor_types: Sequence[str],
          output_tensor_type: str | None, prov: Provenance, calibrated: bool = False,
          target: _Target | None = None, device: torch.device | str = "cpu",
          on_step: Callable[[str, int, int], None] | None = None):  # noqa: ANN202
    overrides = parse_overrides(tensor_types)
    imat = read_imatrix(Path(imatrix)) if imatrix is not None else None
    prov = dataclasses.replace(prov, extra=dict(prov.extra))
    if imat is not None:
        prov.imatrix_file = prov.imatrix_file or str(imatrix)
        prov.imatrix_datasets = imat.datasets
        prov.imatrix_entries = len(imat.sums)
        prov.imatrix_chunks = imat.chunk_count
    auto = None
    if target is None:
        plan = plan_gguf(source, mix or "F16", overrides=overrides, output_tensor_type=output_tensor_type,
                         has_imatrix=imat is not None or calibrated, provenance=prov)  # fmt: skip
    else:
        plan, auto = plan_automatic(source, mix, target_size=target.size, target_bpw=target.bpw, calib=target.calib,
                                    overrides=overrides, output_tensor_type=output_tensor_type, provenance=prov,
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
