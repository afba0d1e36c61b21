"""`convert_to_hf` and `convert_to_gguf`: rewrite a model in another format, tensor by tensor.

GGUF output quantizes as llama-quantize does (same per-tensor types, same bytes), optionally
weighted by an importance matrix; `plan_gguf_file` is the dry run (types and exact size).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from llmopt.errors import OptionError
from llmopt.formats.atomic import check_output
from llmopt.formats.gguf.writer import GgufPlan, PlannedTensor, Provenance, plan_gguf, write_gguf
from llmopt.formats.hf import output_bytes, parse_size, write_hf_dir
from llmopt.formats.imatrix import read_imatrix
from llmopt.model import ModelSource, open_model


def convert_to_hf(model: str | Path, output: str | Path, *, dtype: str = "float16", max_shard_size: str = "5GB",
                  force: bool = False, on_start: Callable[[int], None] | None = None,
                  on_tensor: Callable[[str, int], None] | None = None) -> dict[str, Any]:  # fmt: skip
    """Write `model` (GGUF, HF directory or hub id) as an HF safetensors directory of `dtype` weights.
    `on_start(total_bytes)` and `on_tensor(name, bytes)` follow the progress."""
    shard_bytes = parse_size(max_shard_size)
    start = time.perf_counter()
    with open_model(model) as source:
        total = output_bytes(source, dtype)
        count = len(source.tensors)
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


def plan_gguf_file(model: str | Path, mix: str = "F16", *, imatrix: str | Path | None = None,
                   tensor_types: Sequence[str] = (), output_tensor_type: str | None = None,
                   command: str | None = None) -> tuple[GgufPlan, dict[str, Any]]:  # fmt: skip
    """The GGUF `convert_to_gguf` would write: every tensor's type and the exact file size."""
    with open_model(model) as source:
        plan, _, summary = _plan(source, mix, imatrix, tensor_types, output_tensor_type, command)
    return plan, summary


def convert_to_gguf(model: str | Path, output: str | Path, mix: str = "F16", *, imatrix: str | Path | None = None,
                    tensor_types: Sequence[str] = (), output_tensor_type: str | None = None, force: bool = False,
                    command: str | None = None, on_start: Callable[[int], None] | None = None,
                    on_tensor: Callable[[PlannedTensor, float], None] | None = None) -> dict[str, Any]:  # fmt: skip
    """Write `model` as a GGUF file of llama.cpp type or mix `mix` (F16, Q8_0, Q4_K_M, ...).

    `imatrix` is an importance-matrix file (llama.cpp GGUF or .dat); `tensor_types` are
    `REGEX=TYPE` overrides and `output_tensor_type` the type of output.weight, as llama-quantize's
    --tensor-type and --output-tensor-type. `command` is recorded in the file (`llmopt.command`).
    `on_start(total_bytes)` and `on_tensor(planned, seconds)` follow the progress.
    """
    check_output(Path(output), force)
    start = time.perf_counter()
    with open_model(model) as source:
        plan, imat, _ = _plan(source, mix, imatrix, tensor_types, output_tensor_type, command)
        if on_start is not None:
            on_start(plan.data_nbytes)
        final = write_gguf(source, Path(output), plan, importance=None if imat is None else imat.importance(),
                           force=True, on_tensor=on_tensor)  # fmt: skip
    return {"output": str(final), "format": "gguf", "type": plan.mix, "tensors": len(plan.tensors),
            "bytes": final.stat().st_size, "types": plan.types_count(), "imatrix": str(imatrix) if imatrix else None,
            "seconds": round(time.perf_counter() - start, 3)}  # fmt: skip


def _plan(source: ModelSource, mix: str, imatrix: str | Path | None, tensor_types: Sequence[str],
          output_tensor_type: str | None, command: str | None):  # noqa: ANN202
    overrides = parse_overrides(tensor_types)
    imat = read_imatrix(Path(imatrix)) if imatrix is not None else None
    provenance = Provenance(command=command)
    if imat is not None:
        provenance.imatrix_file = str(imatrix)
        provenance.imatrix_datasets = imat.datasets
        provenance.imatrix_entries = len(imat.sums)
        provenance.imatrix_chunks = imat.chunk_count
    plan = plan_gguf(source, mix, overrides=overrides, output_tensor_type=output_tensor_type,
                     has_imatrix=imat is not None, provenance=provenance)  # fmt: skip
    params = sum(_numel(t.shape) for t in plan.tensors)
    summary = {"type": plan.mix,
               "tensors": [{"tensor": t.gguf_name, "shape": list(t.shape), "type": t.type_name, "bytes": t.nbytes}
                           for t in plan.tensors],
               "types": plan.types_count(), "data_bytes": plan.data_nbytes, "file_bytes": plan.file_nbytes,
               "bits_per_weight": round(8 * plan.data_nbytes / params, 4)}  # fmt: skip
    return plan, imat, summary


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
