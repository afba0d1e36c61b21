"""`llmopt imatrix MODEL --calib TEXT -o imatrix.gguf`: llama.cpp's importance matrix, computed in PyTorch."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from llmopt.cli.common import DeviceOpt, ForceOpt, JsonOpt, VerboseOpt, emit_json, err, out, settings
from llmopt.cli.quantize import print_passes
from llmopt.cli.signature import with_options
from llmopt.errors import OptionError
from llmopt.options import ImatrixOptions


@with_options(ImatrixOptions)
def imatrix_command(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(help="Source: an HF directory, a .gguf file or a hub id.")],
    calib: Annotated[str, typer.Option("--calib", help="Calibration text: .txt/.jsonl/.parquet file, a preset, or self (the samples quantize --calib self takes).")],
    output: Annotated[Optional[Path], typer.Option("-o", "--output", help="Output file (llama.cpp GGUF imatrix format).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the chunks, the memory per block and the estimated "
                                          "time; compute nothing.")] = False,
    force: ForceOpt = False,
    json_out: JsonOpt = False,
    device: DeviceOpt = None,
    verbose: VerboseOpt = 0,
    **options: Any,
) -> None:
    """Compute the mean of x² per input channel of every block linear over calibration text."""
    from llmopt.api.imatrix import imatrix, plan_imatrix

    opts = settings(ctx, json_out, device, verbose)
    if dry_run:
        plan = plan_imatrix(model, calib, ImatrixOptions.of(**options))
        emit_json(plan) if opts.json else print_passes(plan)
        return
    if output is None:
        raise OptionError("imatrix needs <output> FILE (or <dry_run>)")
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("ETA"), TimeRemainingColumn(), console=err, transient=True) as progress:  # fmt: skip
        task = progress.add_task("imatrix", total=None)
        summary = imatrix(model, calib, output, ImatrixOptions.of(**options), force=force, device=opts.device,
                          on_layer=lambda done, total: progress.update(task, completed=done, total=total))  # fmt: skip
    if opts.json:
        emit_json(summary)
    else:
        out.print(f"wrote [bold]{summary['output']}[/] ({summary['entries']} entries, {summary['chunks']} chunks × "
                  f"{summary['chunk_size']} tokens) in {summary['seconds']:.1f}s")  # fmt: skip
