"""`llmopt quantize MODEL --method gptq|awq|awq+gptq|rtn --bits B --group-size G -o DIR`: quantize a model
layer by layer and write a GPTQ or AWQ checkpoint (or a dense dequantized one)."""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from llmopt.cli.common import DeviceOpt, ForceOpt, ShardSizeOpt, JsonOpt, VerboseOpt, emit_json, err, out, settings
from llmopt.cli.options import (ActOrderOpt, BatchSizeOpt, CalibDtypeOpt, CalibFieldOpt, CalibOpt, ClipOpt, DampOpt,
                                GptaqOpt, GroupAwareOpt, NSamplesOpt, SeedOpt, SeqlenOpt, StaticGroupsOpt)
from llmopt.errors import InputError
from llmopt.formats.atomic import atomic_output_file
from llmopt.model.families.base import HEAD
from llmopt.names import CHECKPOINT_FORMATS, METHODS

if TYPE_CHECKING:
    from llmopt.quant.pipeline import BlockResult, LayerReport


Method = Enum("Method", {name: name for name in METHODS}, type=str)  # the library's lists, as choices
Format = Enum("Format", {name: name for name in CHECKPOINT_FORMATS}, type=str)


def quantize_command(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(help="Source: an HF directory, a .gguf file or a hub id.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Output directory.")],
    method: Annotated[Method, typer.Option("--method", help="gptq, awq, awq+gptq (AWQ's scales and clipping, then GPTQ's rounding): calibrated; rtn: round to nearest, no data.")] = Method("gptq"),
    bits: Annotated[int, typer.Option("--bits", help="Bits per weight: 2-8 (GPTQ checkpoints: 2, 3, 4, 8).")] = 4,
    group_size: Annotated[int, typer.Option("--group-size", help="Columns per scale: >0 per group, -1 per output channel, 0 per tensor (rtn).")] = 128,
    sym: Annotated[Optional[bool], typer.Option("--sym/--asym", help="Symmetric grid (no zero point) or asymmetric (zero point per group). Default: --asym for awq methods, --sym otherwise.", show_default=False)] = None,
    act_order: ActOrderOpt = False,
    group_aware: GroupAwareOpt = None,
    static_groups: StaticGroupsOpt = False,
    damp: DampOpt = 0.01,
    mse: Annotated[bool, typer.Option("--mse", help="Search a clipping range per group instead of min/max.")] = False,
    refit_scales: Annotated[bool, typer.Option("--refit-scales", help="GPTQ: re-solve each group's scale for the final codes (least squares on the layer's output error).")] = False,
    gptaq: GptaqOpt = 0.0,
    clip: ClipOpt = True,
    calib: CalibOpt = None,
    calib_field: CalibFieldOpt = None,
    nsamples: NSamplesOpt = 128,
    seqlen: SeqlenOpt = 512,
    seed: SeedOpt = 0,
    calib_dtype: CalibDtypeOpt = "auto",
    fmt: Annotated[Optional[Format], typer.Option("--format", help="gptq or awq: a packed checkpoint (default: awq for awq methods, else gptq); dense: dequantized float16 weights.", show_default=False)] = None,
    target_bpw: Annotated[Optional[float], typer.Option("--target-bpw", help="GPTQ: choose each layer's bits and group size for the least predicted KL divergence at this many bits/weight (GPTQModel's `dynamic`; --bits/--group-size stay the default).", show_default=False)] = None,
    sensitivity_samples: Annotated[int, typer.Option("--sensitivity-samples", help="With --target-bpw: calibration samples the sensitivities are measured on (cached beside -o).")] = 32,
    quantize_head: Annotated[bool, typer.Option("--quantize-head", help="Quantize the LM head too (embeddings and norms never are).")] = False,
    report: Annotated[Optional[Path], typer.Option("--report", help="Write per-layer error metrics as JSON to this file.")] = None,
    batch_size: BatchSizeOpt = 8,
    max_shard_size: ShardSizeOpt = "5GB",
    force: ForceOpt = False,
    json_out: JsonOpt = False,
    device: DeviceOpt = None,
    verbose: VerboseOpt = 0,
) -> None:
    """Quantize a model's linear layers one decoder block at a time (RTN or GPTQ) and write a checkpoint."""
    from llmopt.api.quantize import quantize  # here, not at the top: `llmopt --help` starts without torch

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
                          mse=mse, refit_scales=refit_scales, gptaq=gptaq, clip=clip, calib=calib, calib_field=calib_field,
                          nsamples=nsamples, seqlen=seqlen, seed=seed, calib_dtype=calib_dtype,
                          fmt=fmt.value if fmt is not None else None, target_bpw=target_bpw,
                          sensitivity_samples=sensitivity_samples, quantize_head=quantize_head, batch_size=batch_size, max_shard_size=max_shard_size,
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
    m = result.spec.method
    out.print(f"wrote [bold]{result.output}[/] ({result.fmt}, {m.name} w{m.bits} g{m.group_size} {'sym' if m.sym else 'asym'}) "
              f"in {result.seconds:.1f}s ({per_layer:.2f}s per layer)")
    if result.automix is not None:
        a = result.automix
        counts = ", ".join(f"{n} {name}" for name, n in sorted(a.counts.items()))
        out.print(f"automatic bits: {counts}; {a.bits_per_weight:.3f} bits/weight; predicted KL divergence "
                  f"{a.predicted_kld:.5f} nats/token{' (sensitivities from the cache)' if a.cached else ''}")  # fmt: skip


# The methods' own numbers, as columns when any layer has them: key -> (header, format of the value)
DETAILS = {
    "gptq_loss": ("GPTQ loss", lambda d: f"{d['gptq_loss']:.4g}"),
    "awq_alpha": ("AWQ α", lambda d: "none" if d["awq_alpha"] < 0 else f"{d['awq_alpha']:.2f}"),
    "awq_error_after": ("AWQ out err", lambda d: f"{d['awq_error_before']:.3g}→{d['awq_error_after']:.3g}"),
    "clip_shrink": ("clip", lambda d: f"{d['clip_shrink']:.3f}"),
}


def _metrics_table(reports: list[LayerReport]) -> Table:
    table = Table(title="Weight error per layer", title_justify="left")
    for col in ("layer", "shape", "MSE", "max abs", "cosine", "SQNR dB"):
        table.add_column(col, justify="left" if col in ("layer", "shape") else "right")
    shown = [key for key in DETAILS if any(key in r.details for r in reports)]
    for key in shown:
        table.add_column(DETAILS[key][0], justify="right")
    for r in reports:
        m = r.metrics
        row = [r.name.replace("model.layers.", "") if r.name != HEAD else HEAD, "×".join(map(str, r.shape)),
               f"{m['mse']:.3e}", f"{m['max_abs']:.4f}", f"{m['cosine']:.6f}", f"{m['sqnr_db']:.2f}"]
        row += [DETAILS[key][1](r.details) if key in r.details else "" for key in shown]
        table.add_row(*row)
    return table
