"""`llmopt convert MODEL --to hf|gguf -o OUT`: rewrite a model in another format, streaming tensor by tensor.

`--to gguf --type Q4_K_M` quantizes as llama-quantize does (same per-tensor types, same bytes),
optionally weighted by an importance matrix (`--imatrix`); `--dry-run` prints the plan and size.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.progress import BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

from llmopt.cli.common import DeviceOpt, ForceOpt, JsonOpt, VerboseOpt, emit_json, err, human_bytes, out, settings
from llmopt.cli.quantize import print_passes
from llmopt.cli.signature import option_values, with_options
from llmopt.errors import OptionError
from llmopt.formats.gguf.mixes import MIXES
from llmopt.options import GgufOptions, HfOptions


class Target(str, Enum):
    hf = "hf"
    gguf = "gguf"


@with_options(GgufOptions, HfOptions, help_values={"mixes": ", ".join(MIXES)})
def convert_command(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(help="Source: a .gguf file, an HF directory or a hub id.")],
    to: Annotated[Target, typer.Option("--to", help="Target format.")],
    output: Annotated[Optional[Path], typer.Option("-o", "--output", help="Output directory (hf) or file (gguf).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="GGUF: print the per-tensor plan and exact size only.")] = False,
    force: ForceOpt = False,
    json_out: JsonOpt = False,
    device: DeviceOpt = None,
    verbose: VerboseOpt = 0,
    **options: Any,
) -> None:
    """Convert a model: GGUF -> HF safetensors, or HF/GGUF -> GGUF of any llama.cpp type or mix."""
    opts = settings(ctx, json_out, device, verbose)
    gguf = GgufOptions.of(**option_values(options, GgufOptions))
    if to is Target.gguf:
        _to_gguf(model, output, gguf, dry_run=dry_run, force=force, as_json=opts.json, device=opts.device)
        return
    given = set(gguf.changed())
    if given & {"method", "target_size", "target_bpw"}:
        option = "<method> applies" if "method" in given else "<target_size> and <target_bpw> apply"
        raise OptionError(f"{option} to <to> gguf (a quantized HF checkpoint is `llmopt quantize`)")
    if output is None:
        raise OptionError("<to> hf needs <output> DIR")
    _to_hf(model, output, HfOptions.of(**option_values(options, HfOptions)), force, opts.json)


def _to_hf(model: str, output: Path, o: HfOptions, force: bool, as_json: bool) -> None:
    from llmopt.api.convert import convert_to_hf  # here, not at the top: `llmopt --help` starts without torch

    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn(), console=err, transient=True) as progress:
        task = progress.add_task(f"{Path(model).name} → hf", total=None)
        result = convert_to_hf(model, output, o, force=force,
                               on_start=lambda total: progress.update(task, total=total),
                               on_tensor=lambda name, n: progress.update(task, advance=n, description=name))
    if as_json:
        emit_json(result)
    else:
        out.print(f"wrote [bold]{result['output']}[/] ({result['tensors']} tensors, {human_bytes(result['bytes'])} "
                  f"{o.dtype}) in {result['seconds']:.1f}s")


def _to_gguf(model: str, output: Path | None, o: GgufOptions, *, dry_run: bool, force: bool, as_json: bool,
             device: str) -> None:  # fmt: skip
    """Plan, then (unless --dry-run) write a GGUF of `model` (with a method: calibrated; with a target:
    the automatic mix)."""
    from llmopt.api.convert import convert_to_gguf, plan_gguf_file

    command = shlex.join(["llmopt", *(a for a in sys.argv[1:] if a not in ("--dry-run", "--resume"))])  # what decides the bytes
    automatic = o.target_size is not None or o.target_bpw is not None
    name = f"{Path(model).name} → {o.mix or ('automatic mix' if automatic else 'F16')}"
    if dry_run:
        with _steps(name) as on_step:
            plan, summary = plan_gguf_file(model, command=command, output=output, device=device, on_step=on_step,
                                           options=o)  # fmt: skip
        _print_plan(plan, summary, Path(model).name, as_json)
        return
    if output is None:
        raise OptionError("<to> gguf needs <output> FILE.gguf (or <dry_run>)")
    with _gguf_progress(name, calibrated=o.method is not None) as events:
        result = convert_to_gguf(model, output, force=force, command=command, device=device, options=o, **events)
    if as_json:
        emit_json(result)
    else:
        _print_written(result)


@contextmanager
def _gguf_progress(name: str, calibrated: bool) -> Iterator[dict[str, Callable]]:
    """The bar of a GGUF conversion, as convert_to_gguf's callbacks: bytes written with their ETA; with a
    calibrated method, blocks done (the pipeline's time is per block, not per byte) after the
    calibration text, each with its ETA."""
    columns = (MofNCompleteColumn(),) if calibrated else (DownloadColumn(), TransferSpeedColumn())
    with Progress(TextColumn("{task.description}"), BarColumn(), *columns, TextColumn("ETA"), TimeRemainingColumn(),
                  console=err, transient=True) as progress:  # fmt: skip
        task = progress.add_task(name, total=None)

        def on_tensor(planned, seconds: float) -> None:  # noqa: ANN001
            progress.update(task, advance=0 if calibrated else planned.nbytes,
                            description=f"{planned.gguf_name} {planned.type_name}")  # fmt: skip

        def on_step(stage: str, done: int, total: int) -> None:
            progress.update(task, completed=done, total=total, description=_STAGES[stage])

        def on_start(total: int) -> None:
            if not calibrated:
                progress.update(task, completed=0, total=total, description=name)

        def on_calibration(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total, description="generating calibration text")

        started: list[bool] = []

        def on_block(block, blocks: int) -> None:  # noqa: ANN001
            if not started:  # the bar (and its ETA) counts blocks from the first one
                started.append(True)
                progress.reset(task, total=blocks, description=name)
            progress.update(task, advance=1, description=f"{name} ({block.seconds:.1f}s/layer)")

        yield {"on_start": on_start, "on_tensor": on_tensor, "on_step": on_step,
               **({"on_block": on_block, "on_calibration": on_calibration} if calibrated else {})}


def _print_written(result: dict) -> None:
    counts = ", ".join(f"{n} {k}" for k, n in sorted(result["types"].items()))
    out.print(f"wrote [bold]{result['output']}[/] ({result['type']}: {counts}; {human_bytes(result['bytes'])}) "
              f"in {result['seconds']:.1f}s")
    if "automix" in result:
        auto = result["automix"]
        out.print(f"automatic mix: {result['bytes']} of {auto['target_bytes']} bytes; predicted KL divergence "
                  f"{auto['predicted_kld']:.5f} nats/token")  # fmt: skip


_STAGES = {"fisher": "sensitivity: Fisher pass, block by block (forward, head, backward and rounding)"}


@contextmanager
def _steps(name: str) -> Iterator[Callable[[str, int, int], None]]:
    """A progress bar for the automatic mix's measurement (a dry run does nothing else that takes time)."""
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=err, transient=True) as progress:  # fmt: skip
        task = progress.add_task(name, total=None)
        yield lambda stage, done, total: progress.update(task, completed=done, total=total, description=_STAGES[stage])


def _print_plan(plan, summary: dict, source_name: str, as_json: bool) -> None:  # noqa: ANN001
    if as_json:
        emit_json(summary)
        return
    table = Table(title=f"{source_name} → GGUF {plan.mix}")
    for col, justify in (("tensor", "left"), ("shape", "right"), ("type", "left"), ("size", "right")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for t in plan.tensors:
        table.add_row(t.gguf_name, "×".join(str(d) for d in t.shape), t.type_name, human_bytes(t.nbytes))
    out.print(table)
    counts = ", ".join(f"{n} {k}" for k, n in sorted(plan.types_count().items()))
    out.print(f"{len(plan.tensors)} tensors ({counts}); {summary['bits_per_weight']:.2f} bits/weight; "
              f"file size {plan.file_nbytes} bytes ({human_bytes(plan.file_nbytes)})")  # fmt: skip
    if "passes" in summary:  # a calibrated method or a target: what its streamed passes hold and take
        print_passes(summary)
    auto = summary.get("automix")
    if auto is not None:
        out.print(f"automatic mix: target {auto['target_bytes']} bytes (smallest possible {auto['smallest_bytes']}); "
                  f"predicted KL divergence {auto['predicted_kld']:.5f} nats/token"
                  f"{' (sensitivities from the cache)' if auto['cached'] else ''}")  # fmt: skip

