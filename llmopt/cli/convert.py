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
from typing import Annotated, Optional

import typer
from rich.progress import BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

from llmopt.cli.common import DeviceOpt, ForceOpt, ShardSizeOpt, JsonOpt, VerboseOpt, emit_json, err, human_bytes, out, settings
from llmopt.cli.options import (ActOrderOpt, BatchSizeOpt, CalibDtypeOpt, CalibFieldOpt, CalibOpt, ClipOpt, DampOpt,
                                GptaqOpt, GroupAwareOpt, NSamplesOpt, SeedOpt, SeqlenOpt, StaticGroupsOpt)
from llmopt.errors import OptionError
from llmopt.formats.gguf.mixes import MIXES
from llmopt.names import FLOAT_DTYPES


class Target(str, Enum):
    hf = "hf"
    gguf = "gguf"


DType = Enum("DType", {name: name for name in FLOAT_DTYPES}, type=str)  # the HF writer's dtypes, as choices


def convert_command(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(help="Source: a .gguf file, an HF directory or a hub id.")],
    to: Annotated[Target, typer.Option("--to", help="Target format.")],
    output: Annotated[Optional[Path], typer.Option("-o", "--output", help="Output directory (hf) or file (gguf).")] = None,
    dtype: Annotated[DType, typer.Option("--dtype", help="Float type of the written weights.")] = DType("float16"),
    gguf_type: Annotated[Optional[str], typer.Option("--type", help=f"GGUF type/mix: {', '.join(MIXES)} (default F16; with a target, the label of the file).", show_default=False)] = None,
    imatrix: Annotated[Optional[Path], typer.Option("--imatrix", help="Importance matrix (llama.cpp GGUF or .dat).")] = None,
    tensor_type: Annotated[Optional[list[str]], typer.Option("--tensor-type", help="REGEX=TYPE override (repeatable).")] = None,
    output_tensor_type: Annotated[Optional[str], typer.Option("--output-tensor-type", help="Type of output.weight.")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="GGUF: print the per-tensor plan and exact size only.")] = False,
    method: Annotated[Optional[str], typer.Option("--method", help="GGUF: round the block linears with gptq, awq or awq+gptq (calibrated) onto the mix's types instead of llama.cpp's searches.", show_default=False)] = None,
    target_size: Annotated[Optional[str], typer.Option("--target-size", help="GGUF: automatic mix, the least predicted KL divergence in at most this file size (95MB, 2GiB, bytes).", show_default=False)] = None,
    target_bpw: Annotated[Optional[float], typer.Option("--target-bpw", help="GGUF: automatic mix at this many bits per weight (as --dry-run counts them).", show_default=False)] = None,
    sensitivity_samples: Annotated[int, typer.Option("--sensitivity-samples", help="Automatic mix: calibration samples its sensitivities are measured on (cached beside -o).")] = 32,
    calib: CalibOpt = None,
    calib_field: CalibFieldOpt = None,
    nsamples: NSamplesOpt = 128,
    seqlen: SeqlenOpt = 512,
    seed: SeedOpt = 0,
    calib_dtype: CalibDtypeOpt = "auto",
    damp: DampOpt = 0.01,
    act_order: ActOrderOpt = False,
    static_groups: StaticGroupsOpt = False,
    group_aware: GroupAwareOpt = None,
    gptaq: GptaqOpt = 0.0,
    clip: ClipOpt = True,
    batch_size: BatchSizeOpt = 8,
    max_shard_size: ShardSizeOpt = "5GB",
    force: ForceOpt = False,
    json_out: JsonOpt = False,
    device: DeviceOpt = None,
    verbose: VerboseOpt = 0,
) -> None:
    """Convert a model: GGUF -> HF safetensors, or HF/GGUF -> GGUF of any llama.cpp type or mix."""
    from llmopt.api.convert import convert_to_hf  # here, not at the top: `llmopt --help` starts without torch

    opts = settings(ctx, json_out, device, verbose)
    method_options = dict(method=method, calib=calib, calib_field=calib_field, nsamples=nsamples, seqlen=seqlen,
                          seed=seed, calib_dtype=calib_dtype, damp=damp, act_order=act_order,
                          static_groups=static_groups, group_aware=group_aware, gptaq=gptaq, clip=clip,
                          batch_size=batch_size)  # fmt: skip
    target_options = dict(target_size=target_size, target_bpw=target_bpw, sensitivity_samples=sensitivity_samples)
    if to is Target.gguf:
        _to_gguf(model, output, gguf_type, imatrix=imatrix, tensor_types=tensor_type or [],
                 output_tensor_type=output_tensor_type, dry_run=dry_run, force=force, as_json=opts.json,
                 device=opts.device, method_options=method_options, target_options=target_options)
        return
    if method is not None or target_size is not None or target_bpw is not None:
        option = "<method> applies" if method is not None else "<target_size> and <target_bpw> apply"
        raise OptionError(f"{option} to <to> gguf (a quantized HF checkpoint is `llmopt quantize`)")
    if output is None:
        raise OptionError("<to> hf needs <output> DIR")
    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn(), console=err, transient=True) as progress:
        task = progress.add_task(f"{Path(model).name} → {to.value}", total=None)
        result = convert_to_hf(model, output, dtype=dtype.value, max_shard_size=max_shard_size, force=force,
                               on_start=lambda total: progress.update(task, total=total),
                               on_tensor=lambda name, n: progress.update(task, advance=n, description=name))
    if opts.json:
        emit_json(result)
    else:
        out.print(f"wrote [bold]{result['output']}[/] ({result['tensors']} tensors, {human_bytes(result['bytes'])} "
                  f"{dtype.value}) in {result['seconds']:.1f}s")


def _to_gguf(model: str, output: Path | None, mix: str | None, *, imatrix: Path | None, tensor_types: list[str],
             output_tensor_type: str | None, dry_run: bool, force: bool, as_json: bool, device: str,
             method_options: dict, target_options: dict) -> None:  # fmt: skip
    """Plan, then (unless --dry-run) write a GGUF of `model` under `mix` (with a method: calibrated;
    with a target: the automatic mix)."""
    from llmopt.api.convert import convert_to_gguf, plan_gguf_file

    command = shlex.join(["llmopt", *(a for a in sys.argv[1:] if a != "--dry-run")])
    automatic = target_options["target_size"] is not None or target_options["target_bpw"] is not None
    name = f"{Path(model).name} → {mix or ('automatic mix' if automatic else 'F16')}"
    if dry_run:
        with _steps(name) as on_step:
            plan, summary = plan_gguf_file(model, mix, imatrix=imatrix, tensor_types=tensor_types,
                                           output_tensor_type=output_tensor_type, command=command, output=output,
                                           calib=method_options["calib"], calib_field=method_options["calib_field"],
                                           seqlen=method_options["seqlen"], seed=method_options["seed"],
                                           device=device, on_step=on_step, **target_options)  # fmt: skip
        _print_plan(plan, summary, Path(model).name, as_json)
        return
    if output is None:
        raise OptionError("<to> gguf needs <output> FILE.gguf (or <dry_run>)")
    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn(), console=err, transient=True) as progress:  # fmt: skip
        task = progress.add_task(name, total=None)

        def on_tensor(planned, seconds: float) -> None:  # noqa: ANN001
            progress.update(task, advance=planned.nbytes, description=f"{planned.gguf_name} {planned.type_name}")

        def on_step(stage: str, done: int, total: int) -> None:
            progress.update(task, completed=done, total=total, description=_STAGES[stage])

        def on_start(total: int) -> None:
            progress.update(task, completed=0, total=total, description=name)

        result = convert_to_gguf(model, output, mix, imatrix=imatrix, tensor_types=tensor_types,
                                 output_tensor_type=output_tensor_type, force=force, command=command, device=device,
                                 on_start=on_start, on_tensor=on_tensor, on_step=on_step,
                                 **method_options, **target_options)  # fmt: skip
    if as_json:
        emit_json(result)
    else:
        counts = ", ".join(f"{n} {k}" for k, n in sorted(result["types"].items()))
        out.print(f"wrote [bold]{result['output']}[/] ({result['type']}: {counts}; {human_bytes(result['bytes'])}) "
                  f"in {result['seconds']:.1f}s")
        if "automix" in result:
            auto = result["automix"]
            out.print(f"automatic mix: {result['bytes']} of {auto['target_bytes']} bytes; predicted KL divergence "
                      f"{auto['predicted_kld']:.5f} nats/token")  # fmt: skip


_STAGES = {"fisher": "sensitivity: Fisher diagonal (samples)", "round": "sensitivity: every type of every tensor"}


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
    auto = summary.get("automix")
    if auto is not None:
        out.print(f"automatic mix: target {auto['target_bytes']} bytes (smallest possible {auto['smallest_bytes']}); "
                  f"predicted KL divergence {auto['predicted_kld']:.5f} nats/token"
                  f"{' (sensitivities from the cache)' if auto['cached'] else ''}")  # fmt: skip

