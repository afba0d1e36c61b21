"""`llmopt quantize MODEL --method gptq|rtn --bits B --group-size G -o DIR`: quantize a model layer by layer
and write a GPTQ checkpoint (or a dense dequantized one)."""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from llmopt.api.quantize import quantize
from llmopt.cli.common import DeviceOpt, ForceOpt, ShardSizeOpt, JsonOpt, VerboseOpt, emit_json, err, out, settings
from llmopt.device import CALIB_DTYPES
from llmopt.errors import InputError
from llmopt.formats.atomic import atomic_output_file
from llmopt.formats.gptq import FORMATS
from llmopt.model.families.base import HEAD
from llmopt.quant.pipeline import BlockResult, LayerReport
from llmopt.quant.spec import METHODS


Method = Enum("Method", {name: name for name in METHODS}, type=str)  # the library's lists, as choices
Format = Enum("Format", {name: name for name in FORMATS}, type=str)


def quantize_command(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(help="Source: an HF directory, a .gguf file or a hub id.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Output directory.")],
    method: Annotated[Method, typer.Option("--method", help="gptq (calibrated) or rtn (round to nearest, no data).")] = Method("gptq"),
    bits: Annotated[int, typer.Option("--bits", help="Bits per weight: 2-8 (GPTQ checkpoints: 2, 3, 4, 8).")] = 4,
    group_size: Annotated[int, typer.Option("--group-size", help="Columns per scale: >0 per group, -1 per output channel, 0 per tensor (rtn).")] = 128,
    sym: Annotated[bool, typer.Option("--sym/--asym", help="Symmetric grid (no zero point) or asymmetric (zero point per group).")] = True,
    act_order: Annotated[bool, typer.Option("--act-order", help="GPTQ: quantize columns by decreasing activation energy (desc_act).")] = False,
    group_aware: Annotated[Optional[bool], typer.Option("--group-aware-order/--no-group-aware-order", help="GPTQ: act-order inside contiguous groups (GPTQModel's act_group_aware; no g_idx). On by default with groups, unless --act-order or --static-groups.", show_default=False)] = None,
    static_groups: Annotated[bool, typer.Option("--static-groups", help="GPTQ: choose group scales before quantizing (keeps groups contiguous under --act-order).")] = False,
    damp: Annotated[float, typer.Option("--damp", help="GPTQ: dampening, a fraction of the mean Hessian diagonal (raised automatically if needed).")] = 0.01,
    mse: Annotated[bool, typer.Option("--mse", help="Search a clipping range per group instead of min/max.")] = False,
    refit_scales: Annotated[bool, typer.Option("--refit-scales", help="GPTQ: re-solve each group's scale for the final codes (least squares on the layer's output error).")] = False,
    gptaq: Annotated[float, typer.Option("--gptaq", help="GPTQ: pull each layer toward the full-precision model's output (GPTAQ / GPTQ v2), strength in (0, 1]; 0 = off.")] = 0.0,
    calib: Annotated[Optional[str], typer.Option("--calib", help="Calibration text: a .txt/.jsonl/.parquet file, a preset (wikitext2, c4, pileval; online), or 'self' (model-generated, the default).")] = None,
    calib_field: Annotated[Optional[str], typer.Option("--calib-field", help="Text field of .jsonl/.parquet records [default: text].")] = None,
    nsamples: Annotated[int, typer.Option("--nsamples", help="Calibration samples.")] = 128,
    seqlen: Annotated[int, typer.Option("--seqlen", help="Tokens per calibration sample.")] = 512,
    seed: Annotated[int, typer.Option("--seed", help="Seed for sampling windows (and for --calib self).")] = 0,
    calib_dtype: Annotated[str, typer.Option("--calib-dtype", help=f"GPTQ: dtype of the calibration forward ({' | '.join(CALIB_DTYPES)}); auto = bfloat16 where the device has it natively, else float32. Hessians and weights stay float32.")] = "auto",
    fmt: Annotated[Format, typer.Option("--format", help="gptq: packed GPTQ checkpoint; dense: dequantized float16 weights.")] = Format("gptq"),
    quantize_head: Annotated[bool, typer.Option("--quantize-head", help="Quantize the LM head too (embeddings and norms never are).")] = False,
    report: Annotated[Optional[Path], typer.Option("--report", help="Write per-layer error metrics as JSON to this file.")] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Calibration samples per forward pass.")] = 8,
    max_shard_size: ShardSizeOpt = "5GB",
    force: ForceOpt = False,
    json_out: JsonOpt = False,
    device: DeviceOpt = None,
    verbose: VerboseOpt = 0,
) -> None:
    """Quantize a model's linear layers one decoder block at a time (RTN or GPTQ) and write a checkpoint."""
    opts = settings(ctx, json_out, device, verbose)
    if report is not None and report.expanduser().is_dir():
        raise InputError(f"--report {report}: is a directory")
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("ETA"), TimeRemainingColumn(), console=err, transient=True, disable=opts.json) as progress:
        calib_task = None
        task = None

        def on_calibration(done: int, total: int) -> None:
            nonlocal calib_task
            if calib_task is None:
                calib_task = progress.add_task("generating calibration text", total=total)
            progress.update(calib_task, completed=done, total=total)

        def on_block(r: BlockResult, blocks: int) -> None:
            nonlocal task
            if task is None:
                task = progress.add_task(f"{method.value} w{bits}", total=blocks)
            label = "head" if r.layer < 0 else f"layer {r.layer + 1}/{blocks}"
            progress.update(task, advance=1, description=f"{method.value} w{bits} {label} ({r.seconds:.1f}s/layer)")
            if opts.verbose:
                err.print(f"{label}: {r.seconds:.2f}s")

        result = quantize(model, output, method=method.value, bits=bits, group_size=group_size, sym=sym,
                          act_order=act_order, group_aware=group_aware, static_groups=static_groups, damp=damp,
                          mse=mse, refit_scales=refit_scales, gptaq=gptaq, calib=calib, calib_field=calib_field,
                          nsamples=nsamples, seqlen=seqlen, seed=seed, calib_dtype=calib_dtype, fmt=fmt.value,
                          quantize_head=quantize_head, batch_size=batch_size, max_shard_size=max_shard_size,
                          force=force, device=opts.device, on_block=on_block, on_calibration=on_calibration)
    summary = result.to_dict()
    if report is not None:
        with atomic_output_file(report) as tmp:
            tmp.write_text(json.dumps(summary, indent=2) + "\n")
    if opts.json:
        emit_json(summary)
        return
    out.print(_metrics_table(result.reports))
    per_layer = sum(s for _, s in result.block_seconds) / max(len(result.block_seconds), 1)
    out.print(f"wrote [bold]{result.output}[/] ({fmt.value}, {method.value} w{bits} g{group_size} {'sym' if sym else 'asym'}) "
              f"in {result.seconds:.1f}s ({per_layer:.2f}s per layer)")


def _metrics_table(reports: list[LayerReport]) -> Table:
    table = Table(title="Weight error per layer", title_justify="left")
    for col in ("layer", "shape", "MSE", "max abs", "cosine", "SQNR dB"):
        table.add_column(col, justify="left" if col in ("layer", "shape") else "right")
    gptq = any("gptq_loss" in r.details for r in reports)
    if gptq:
        table.add_column("GPTQ loss", justify="right")
    for r in reports:
        m = r.metrics
        row = [r.name.replace("model.layers.", "") if r.name != HEAD else HEAD, "×".join(map(str, r.shape)),
               f"{m['mse']:.3e}", f"{m['max_abs']:.4f}", f"{m['cosine']:.6f}", f"{m['sqnr_db']:.2f}"]
        if gptq:
            row.append("" if "gptq_loss" not in r.details else f"{r.details['gptq_loss']:.4g}")
        table.add_row(*row)
    return table
