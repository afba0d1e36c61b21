"""`llmopt quantize MODEL --method gptq|awq|awq+gptq|rtn --bits B --group-size G -o DIR`: quantize a model
layer by layer and write a GPTQ or AWQ checkpoint (or a dense dequantized one)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from llmopt.cli.common import DeviceOpt, ForceOpt, JsonOpt, Settings, VerboseOpt, emit_json, err, out, settings
from llmopt.cli.signature import with_options
from llmopt.errors import InputError, OptionError
from llmopt.formats.atomic import atomic_output_file
from llmopt.model.families.base import HEAD
from llmopt.options import QuantizeOptions
from llmopt.plan.footprint import gb

if TYPE_CHECKING:
    from llmopt.api.quantize import QuantizeResult
    from llmopt.quant.pipeline import BlockResult, LayerReport


@with_options(QuantizeOptions)
def quantize_command(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(help="Source: an HF directory, a .gguf file or a hub id.")],
    output: Annotated[Optional[Path], typer.Option("-o", "--output", help="Output directory.")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan (method, blocks, calibration tokens, "
                                          "memory per block, estimated time) and write nothing.")] = False,
    report: Annotated[Optional[Path], typer.Option("--report", help="Write per-layer error metrics as JSON to this file.")] = None,
    force: ForceOpt = False,
    json_out: JsonOpt = False,
    device: DeviceOpt = None,
    verbose: VerboseOpt = 0,
    **options: Any,
) -> None:
    """Quantize a model's linear layers one decoder block at a time (RTN or GPTQ) and write a checkpoint."""
    from llmopt.api.quantize import plan_quantize, quantize  # here, not at the top: `llmopt --help` starts without torch

    opts = settings(ctx, json_out, device, verbose)
    if report is not None and report.expanduser().is_dir():
        raise InputError(f"--report {report}: is a directory")
    o = QuantizeOptions.of(**options)
    if dry_run:
        plan = plan_quantize(model, o, device=opts.device)
        if opts.json:
            emit_json(plan)
        else:
            out.print(f"{Path(model).name}: {plan['method']} -> {plan['format']} checkpoint")
            print_passes(plan)
        return
    if output is None:
        raise OptionError("quantize needs <output> DIR (or <dry_run>)")
    with _progress(f"{o.method_name} w{o.bits}", opts) as (on_calibration, on_block, on_step):
        result = quantize(model, output, o, force=force, device=opts.device, on_block=on_block,
                          on_calibration=on_calibration, on_step=on_step)  # fmt: skip
    summary = result.to_dict()
    if report is not None:
        with atomic_output_file(report) as tmp:
            tmp.write_text(json.dumps(summary, indent=2) + "\n")
    if opts.json:
        emit_json(summary)
        return
    _print_result(result)


@contextmanager
def _progress(label: str, opts: Settings) -> Iterator[tuple[Callable, Callable, Callable]]:
    """Progress bars (with ETA) for self-written calibration text, the blocks and the automatic mix's
    Fisher pass, as (on_calibration, on_block, on_step)."""
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("ETA"), TimeRemainingColumn(), console=err, transient=True, disable=opts.json) as progress:
        tasks: dict[str, TaskID] = {}

        def on_calibration(done: int, total: int) -> None:
            if "calib" not in tasks:
                tasks["calib"] = progress.add_task("generating calibration text", total=total)
            progress.update(tasks["calib"], completed=done, total=total)

        def on_block(r: BlockResult, blocks: int) -> None:
            if "blocks" not in tasks:
                tasks["blocks"] = progress.add_task(label, total=blocks)
            where = "head" if r.layer < 0 else f"layer {r.layer + 1}/{blocks}"
            progress.update(tasks["blocks"], advance=1, description=f"{label} {where} ({r.seconds:.1f}s/layer)")
            if opts.verbose:
                err.print(f"{where}: {r.seconds:.2f}s")

        def on_step(_stage: str, done: int, total: int) -> None:  # the automatic mix's Fisher pass
            if "fisher" not in tasks:
                tasks["fisher"] = progress.add_task("automatic mix: Fisher pass (forward, head, backward)", total=total)
            progress.update(tasks["fisher"], completed=done, total=total)

        yield on_calibration, on_block, on_step


def print_passes(plan: dict) -> None:
    """A dry run's passes (api/budget.py's `dry_run`): blocks, tokens, memory per block, estimated time."""
    where = "" if plan["available_from"] == "available" else f" ({plan['available_from']})"
    for p in plan["passes"]:
        name = {"sensitivity": "automatic mix: Fisher pass", "imatrix": "imatrix"}.get(p["pass"], p["pass"])
        out.print(f"{name}: {p['blocks']} blocks, {p['samples']} x {p['seqlen']} calibration tokens")
        verdict = "fits" if p["fits"] else "[bold red]does not fit[/]"
        out.print(f"  memory: one block needs {p['memory']}; {gb(plan['available_bytes'])} available{where}: {verdict}"
                  + ("" if p["footprint"]["peak_step"] == "one block" else
                     f"; the {p['footprint']['peak_step']} step needs {gb(p['footprint']['peak_bytes'])}"))  # fmt: skip
        if p["seconds"] is not None:
            out.print(f"  time: about {p['seconds_per_block']:.1f} s per block, {duration(p['seconds'])} in all "
                      f"(estimated for this machine); on an {p['gpu']}, at least {duration(p['gpu_seconds'])}")  # fmt: skip


def duration(seconds: float) -> str:
    if seconds < 10:  # a GPU's floor for one block is a fraction of a second: say so, not "0 s"
        return f"{seconds:.2g} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def _print_result(result: QuantizeResult) -> None:
    out.print(_metrics_table(result.reports))
    per_layer = sum(s for _, s in result.block_seconds) / max(len(result.block_seconds), 1)
    m = result.spec.method
    out.print(f"wrote [bold]{result.output}[/] ({result.fmt}, {m.name} w{m.bits} g{m.group_size} {'sym' if m.sym else 'asym'}) "
              f"in {result.seconds:.1f}s ({per_layer:.2f}s per layer)")
    if result.resumed_blocks:
        out.print(f"resumed: {result.resumed_blocks} blocks came from the killed run's progress folder")
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
