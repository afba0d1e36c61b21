"""`llmopt eval MODEL --data FILE [--ref REF]`: perplexity, KL and top-1 agreement, optionally gated."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from llmopt.api.evaluate import evaluate
from llmopt.cli.common import DeviceOpt, JsonOpt, VerboseOpt, emit_json, err, out, settings
from llmopt.cli.generate import DTypeOpt, PackedOpt, ThreadsOpt
from llmopt.errors import CheckFailed
from llmopt.runtime.weights import set_threads


def eval_command(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(help="Model to evaluate: .gguf file, HF directory (float or GPTQ) or hub id.")],
    data: Annotated[Path, typer.Option("--data", help="UTF-8 text file, e.g. wikitext-2/test.txt.")],
    ref: Annotated[Optional[str], typer.Option("--ref", help="Reference model (same tokenizer) for KL and top-1.")] = None,
    ctx_len: Annotated[int, typer.Option("--ctx", help="Tokens per window.")] = 512,
    windows: Annotated[int, typer.Option("--windows", help="Number of windows from the start of the text (0 = all).")] = 40,
    max_ppl_increase: Annotated[Optional[float], typer.Option("--max-ppl-increase", help="Gate: fail if perplexity rises more than PCT % over --ref.")] = None,
    min_top1: Annotated[Optional[float], typer.Option("--min-top1", help="Gate: fail if top-1 agreement with --ref is below PCT %.")] = None,
    threads: ThreadsOpt = 0,
    packed: PackedOpt = False,
    dtype: DTypeOpt = "auto",
    json_out: JsonOpt = False,
    device: DeviceOpt = None,
    verbose: VerboseOpt = 0,
) -> None:
    """Perplexity over non-overlapping windows; with --ref, KL divergence and top-1 agreement too."""
    opts = settings(ctx, json_out, device, verbose)
    set_threads(threads)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=err, transient=True) as progress:
        task = progress.add_task(f"eval {Path(model).name}", total=None)
        result, gates, summary = evaluate(model, data, ref=ref, ctx=ctx_len, windows=windows,
                                          max_ppl_increase=max_ppl_increase, min_top1=min_top1, dtype=dtype,
                                          device=opts.device, packed=packed,
                                          on_window=lambda done, total: progress.update(task, completed=done, total=total))
    failed = [g for g in gates if not g.passed]

    if opts.json:
        emit_json(summary)
    else:
        table = Table(show_header=False, box=None)
        table.add_row("windows x ctx", f"{result.windows} x {result.ctx} ({result.tokens_scored} tokens scored)")
        table.add_row("perplexity", f"{result.perplexity:.4f}")
        if result.ref_perplexity is not None:
            table.add_row("ref perplexity", f"{result.ref_perplexity:.4f} ({result.ppl_increase_pct:+.2f}%)")
            table.add_row("KL(ref || model)", f"{result.kl_divergence:.5f} nats/token")
            table.add_row("top-1 agreement", f"{100 * result.top1_agreement:.2f}%")
        for g in gates:
            table.add_row("gate", g.line())
        out.print(table)
    if failed:
        raise CheckFailed("; ".join(g.line() for g in failed))
