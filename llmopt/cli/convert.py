"""`llmopt convert MODEL --to hf -o DIR`: rewrite a model in another format, streaming tensor by tensor."""

from __future__ import annotations

import time
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from llmopt.cli.common import DeviceOpt, JsonOpt, VerboseOpt, emit_json, err, human_bytes, out, settings
from llmopt.formats.hf import DTYPES, output_bytes, parse_size, write_hf_dir
from llmopt.model import open_model


class Target(str, Enum):
    hf = "hf"


class DType(str, Enum):
    float16 = "float16"
    bfloat16 = "bfloat16"
    float32 = "float32"


def convert_command(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(help="Source: a .gguf file, an HF directory or a hub id.")],
    to: Annotated[Target, typer.Option("--to", help="Target format.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Output directory.")],
    dtype: Annotated[DType, typer.Option("--dtype", help="Float type of the written weights.")] = DType.float16,
    max_shard_size: Annotated[str, typer.Option("--max-shard-size", help="Largest safetensors shard, e.g. 5GB, 500MB.")] = "5GB",
    force: Annotated[bool, typer.Option("--force", help="Replace the output if it exists.")] = False,
    json_out: JsonOpt = False,
    device: DeviceOpt = None,
    verbose: VerboseOpt = 0,
) -> None:
    """Convert a model, e.g. a GGUF file to an HF directory of safetensors (dequantized to --dtype)."""
    opts = settings(ctx, json_out, device, verbose)
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


assert set(DTYPES) == {d.value for d in DType}
