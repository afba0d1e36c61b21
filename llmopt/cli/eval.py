"""`llmopt eval MODEL... --data FILE [--ref REF] [--plot PNG]`: perplexity, KL and top-1 agreement,
optionally gated; several models give one table (size, bits/weight, ...) and the KL-vs-size plot."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from llmopt.cli.common import DeviceOpt, JsonOpt, VerboseOpt, emit_json, err, human_bytes, out, settings
from llmopt.cli.signature import option_values, with_options
from llmopt.options import EvalOptions, ThreadsOptions
from llmopt.errors import CheckFailed


@with_options(EvalOptions, ThreadsOptions)
def eval_command(
    context: typer.Context,
    models: Annotated[list[str], typer.Argument(help="Models to evaluate: .gguf files, HF directories (float, GPTQ or AWQ) or hub ids.", show_default=False)],
    data: Annotated[Path, typer.Option("--data", help="UTF-8 text file, e.g. wikitext-2/test.txt.")],
    ref: Annotated[Optional[str], typer.Option("--ref", help="Reference model (same tokenizer) for KL and top-1.")] = None,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="With --ref: write a PNG of KL divergence against file size (the Pareto view).", show_default=False)] = None,
    json_out: JsonOpt = False,
    device: DeviceOpt = None,
    verbose: VerboseOpt = 0,
    **options: Any,
) -> None:
    """Perplexity over non-overlapping windows; with --ref, KL divergence and top-1 agreement too."""
    from llmopt.api.evaluate import evaluate_files  # here, not at the top: `llmopt --help` starts without torch
    from llmopt.runtime.weights import set_threads

    opts = settings(context, json_out, device, verbose)
    set_threads(ThreadsOptions.of(**option_values(options, ThreadsOptions)).threads)
    o = EvalOptions.of(**option_values(options, EvalOptions))
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=err, transient=True) as progress:
        task = progress.add_task("eval", total=None)

        def on_window(i: int, done: int, total: int) -> None:
            progress.update(task, completed=done, total=total, description=f"eval {Path(models[i]).name}")

        rows = evaluate_files(models, data, o, ref=ref, device=opts.device, plot=plot, on_window=on_window)
    failed = [g for _, gates, _ in rows for g in gates if not g.passed]
    if opts.json:
        emit_json(rows[0][2] if len(rows) == 1 else {"models": [s for _, _, s in rows], "plot": str(plot) if plot else None})
    elif len(rows) == 1:
        _print_one(*rows[0])
    else:
        _print_table(rows)
    if plot is not None and not opts.json:
        out.print(f"wrote [bold]{plot}[/]")
    if failed:
        raise CheckFailed("; ".join(g.line() for g in failed))


def _print_one(result, gates, summary) -> None:  # noqa: ANN001
    table = Table(show_header=False, box=None)
    table.add_row("windows x ctx", f"{result.windows} x {result.ctx} ({result.tokens_scored} tokens scored)")
    if summary["streamed"]:
        table.add_row("run", "streamed, one block at a time")
    table.add_row("perplexity", f"{result.perplexity:.4f}")
    if result.ref_perplexity is not None:
        table.add_row("ref perplexity", f"{result.ref_perplexity:.4f} ({result.ppl_increase_pct:+.2f}%)")
        table.add_row("KL(ref || model)", f"{result.kl_divergence:.5f} nats/token")
        table.add_row("top-1 agreement", f"{100 * result.top1_agreement:.2f}%")
    for g in gates:
        table.add_row("gate", g.line())
    out.print(table)


def _print_table(rows) -> None:  # noqa: ANN001
    first = rows[0][0]
    with_ref = first.ref_perplexity is not None
    title = f"{first.windows} x {first.ctx} tokens" + (f"; ref PPL {first.ref_perplexity:.4f}; KLD = KL(ref || model), "
                                                       f"front = on the Pareto front of KLD vs size" if with_ref else "")
    title += "; streamed, one block at a time" if rows[0][2]["streamed"] else ""
    table = Table(title=title)
    columns = ["model", "size", "bpw", "PPL"] + (["KLD", "top-1", "front"] if with_ref else [])
    for col in columns:
        table.add_column(col, justify="left" if col == "model" else "right")
    for result, gates, s in rows:
        cells = [Path(s["model"]).name, human_bytes(s["bytes"]), f"{s['bits_per_weight']:.3f}", f"{result.perplexity:.4f}"]
        if with_ref:
            cells += [f"{result.kl_divergence:.5f}", f"{100 * result.top1_agreement:.2f}%", "*" if s.get("pareto") else ""]
        table.add_row(*cells)
    out.print(table)
    for _, gates, s in rows:
        for g in gates:
            out.print(f"{Path(s['model']).name}: gate {g.line()}")
