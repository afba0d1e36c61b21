"""`llmopt convert MODEL --to hf|gguf -o OUT`: rewrite a model in another format, streaming tensor by tensor.

`--to gguf --type Q4_K_M` quantizes as llama-quantize does (same per-tensor types, same bytes),
optionally weighted by an importance matrix (`--imatrix`); `--dry-run` prints the plan and size.
"""

from __future__ import annotations

import math
import time
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

from llmopt.cli.common import DeviceOpt, ForceOpt, ShardSizeOpt, JsonOpt, VerboseOpt, emit_json, err, human_bytes, out, settings
from llmopt.errors import InputError
from llmopt.formats.gguf.mixes import MIXES
from llmopt.formats.hf import DTYPES, output_bytes, parse_size, write_hf_dir
from llmopt.model import open_model


class Target(str, Enum):
    hf = "hf"
    gguf = "gguf"


class DType(str, Enum):
    float16 = "float16"
    bfloat16 = "bfloat16"
    float32 = "float32"


def convert_command(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(help="Source: a .gguf file, an HF directory or a hub id.")],
    to: Annotated[Target, typer.Option("--to", help="Target format.")],
    output: Annotated[Optional[Path], typer.Option("-o", "--output", help="Output directory (hf) or file (gguf).")] = None,
    dtype: Annotated[DType, typer.Option("--dtype", help="Float type of the written weights.")] = DType.float16,
    gguf_type: Annotated[str, typer.Option("--type", help=f"GGUF type/mix: {', '.join(MIXES)}.")] = "F16",
    imatrix: Annotated[Optional[Path], typer.Option("--imatrix", help="Importance matrix (llama.cpp GGUF or .dat).")] = None,
    tensor_type: Annotated[Optional[list[str]], typer.Option("--tensor-type", help="REGEX=TYPE override (repeatable).")] = None,
    output_tensor_type: Annotated[Optional[str], typer.Option("--output-tensor-type", help="Type of output.weight.")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="GGUF: print the per-tensor plan and exact size only.")] = False,
    max_shard_size: ShardSizeOpt = "5GB",
    force: ForceOpt = False,
    json_out: JsonOpt = False,
    device: DeviceOpt = None,
    verbose: VerboseOpt = 0,
) -> None:
    """Convert a model: GGUF -> HF safetensors, or HF/GGUF -> GGUF of any llama.cpp type or mix."""
    opts = settings(ctx, json_out, device, verbose)
    if to is Target.gguf:
        gguf_convert(model, output, gguf_type, imatrix=imatrix, tensor_type=tensor_type or [],
                     output_tensor_type=output_tensor_type, dry_run=dry_run, force=force, as_json=opts.json)
        return
    if output is None:
        raise InputError("--to hf needs -o/--output DIR")
    shard_bytes = parse_size(max_shard_size)
    start = time.perf_counter()
    with open_model(model) as source:
        total = output_bytes(source, dtype.value)
        count = len(source.tensors)
        with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                      TimeRemainingColumn(), console=err, transient=True) as progress:
            task = progress.add_task(f"{source.path.name} → {to.value}", total=total)
            final = write_hf_dir(source, output, dtype.value, shard_bytes, force,
                                 on_tensor=lambda name, n: progress.update(task, advance=n, description=name))
    seconds = time.perf_counter() - start
    result = {"output": str(final), "format": to.value, "dtype": dtype.value, "tensors": count, "bytes": total,
              "seconds": round(seconds, 3)}
    if opts.json:
        emit_json(result)
    else:
        out.print(f"wrote [bold]{final}[/] ({count} tensors, {human_bytes(total)} {dtype.value}) in {seconds:.1f}s")



def parse_overrides(specs: list[str]) -> list[tuple[str, str]]:
    """--tensor-type REGEX=TYPE pairs (the last '=' separates, as llama-quantize splits them)."""
    pairs = []
    for spec in specs:
        pattern, sep, type_name = spec.rpartition("=")
        if not sep or not pattern or not type_name:
            raise InputError(f"--tensor-type {spec!r}: expected REGEX=TYPE, e.g. 'attn_v=Q8_0'")
        pairs.append((pattern, type_name.upper()))
    return pairs


def gguf_convert(model: str, output: Path | None, mix: str, *, imatrix: Path | None, tensor_type: list[str],
                 output_tensor_type: str | None, dry_run: bool, force: bool, as_json: bool) -> None:  # fmt: skip
    """Plan, then (unless --dry-run) write a GGUF of `model` under `mix`."""
    import shlex
    import sys

    from llmopt.calibration.imatrix import read_imatrix
    from llmopt.formats.gguf.writer import Provenance, plan_gguf, write_gguf

    overrides = parse_overrides(tensor_type)
    imat = read_imatrix(imatrix) if imatrix is not None else None
    provenance = Provenance(command=shlex.join(["llmopt", *(a for a in sys.argv[1:] if a != "--dry-run")]))
    if imat is not None:
        provenance.imatrix_file = str(imatrix)
        provenance.imatrix_datasets = imat.datasets
        provenance.imatrix_entries = len(imat.sums)
        provenance.imatrix_chunks = imat.chunk_count
    if not dry_run:
        if output is None:
            raise InputError("--to gguf needs -o/--output FILE.gguf (or --dry-run)")
        if output.exists() and not force:
            raise InputError(f"{output}: already exists (use --force to replace it)")
    start = time.perf_counter()
    with open_model(model) as source:
        plan = plan_gguf(source, mix, overrides=overrides, output_tensor_type=output_tensor_type,
                         has_imatrix=imat is not None, provenance=provenance)  # fmt: skip
        if dry_run:
            _print_plan(plan, source, as_json)
            return
        total = sum(t.nbytes for t in plan.tensors)
        with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                      TimeRemainingColumn(), console=err, transient=True) as progress:  # fmt: skip
            task = progress.add_task(f"{source.path.name} → {plan.mix}", total=total)

            def on_tensor(planned, seconds: float) -> None:  # noqa: ANN001
                progress.update(task, advance=planned.nbytes, description=f"{planned.gguf_name} {planned.type_name}")

            final = write_gguf(source, output, plan, importance=None if imat is None else imat.importance(),
                               force=True, on_tensor=on_tensor)  # fmt: skip
    seconds = time.perf_counter() - start
    size = final.stat().st_size
    result = {"output": str(final), "format": "gguf", "type": plan.mix, "tensors": len(plan.tensors), "bytes": size,
              "types": plan.types_count(), "imatrix": str(imatrix) if imatrix else None, "seconds": round(seconds, 3)}
    if as_json:
        emit_json(result)
    else:
        counts = ", ".join(f"{n} {k}" for k, n in sorted(plan.types_count().items()))
        out.print(f"wrote [bold]{final}[/] ({plan.mix}: {counts}; {human_bytes(size)}) in {seconds:.1f}s")


def _print_plan(plan, source, as_json: bool) -> None:  # noqa: ANN001
    rows = [{"tensor": t.gguf_name, "shape": list(t.shape), "type": t.type_name, "bytes": t.nbytes} for t in plan.tensors]
    params = sum(math.prod(t.shape) for t in plan.tensors)
    summary = {"type": plan.mix, "tensors": rows, "types": plan.types_count(), "data_bytes": plan.data_nbytes,
               "file_bytes": plan.file_nbytes, "bits_per_weight": round(8 * plan.data_nbytes / params, 4)}
    if as_json:
        emit_json(summary)
        return
    table = Table(title=f"{source.path.name} → GGUF {plan.mix}")
    for col, justify in (("tensor", "left"), ("shape", "right"), ("type", "left"), ("size", "right")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for t in plan.tensors:
        table.add_row(t.gguf_name, "×".join(str(d) for d in t.shape), t.type_name, human_bytes(t.nbytes))
    out.print(table)
    counts = ", ".join(f"{n} {k}" for k, n in sorted(plan.types_count().items()))
    out.print(f"{len(plan.tensors)} tensors ({counts}); {summary['bits_per_weight']:.2f} bits/weight; "
              f"file size {plan.file_nbytes} bytes ({human_bytes(plan.file_nbytes)})")  # fmt: skip


assert set(DTYPES) == {d.value for d in DType}
