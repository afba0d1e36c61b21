"""`llmopt eval MODEL --data FILE [--ref REF]`: perplexity, KL and top-1 agreement, optionally gated."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from llmopt.cli.common import DeviceOpt, JsonOpt, VerboseOpt, emit_json, err, out, settings
from llmopt.cli.generate import DTypeOpt, PackedOpt, ThreadsOpt
from llmopt.errors import CheckFailed, InputError
from llmopt.eval.gates import check_gates
from llmopt.eval.perplexity import evaluate, token_windows
from llmopt.runtime.weights import load_model, set_threads


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
    if (max_ppl_increase is not None or min_top1 is not None) and ref is None:
        raise InputError("--max-ppl-increase and --min-top1 compare against a reference: give --ref MODEL")
    try:
        text = data.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{data}: cannot read ({e.__class__.__name__})") from None

    target = load_model(model, dtype, opts.device, packed)
    if target.tokenizer is None:
        raise InputError(f"{model}: has no tokenizer, so it cannot read text")
    ids = target.tokenizer.encode(text)
    chunks = token_windows(ids, ctx_len, windows)
    reference = None
    if ref is not None:
        reference = load_model(ref, dtype, opts.device, packed)
        sample = text[:20000]  # both tokenizers on the same text (a cut prefix ends differently from the whole)
        if reference.model.arch.vocab_size != target.model.arch.vocab_size or (
                reference.tokenizer is not None and reference.tokenizer.encode(sample) != target.tokenizer.encode(sample)):
            raise InputError(f"--ref {ref}: its tokenizer differs from the model's; KL and top-1 need the same vocabulary")

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=err, transient=True) as progress:
        task = progress.add_task(f"eval {Path(model).name}", total=chunks.shape[0])
        result = evaluate(target.model, chunks, reference.model if reference else None,
                          on_window=lambda i: progress.update(task, completed=i + 1))
    gates = check_gates(result, max_ppl_increase, min_top1)
    failed = [g for g in gates if not g.passed]

    if opts.json:
        emit_json({"model": target.path, "ref": reference.path if reference else None, "data": str(data),
                   "dtype": str(target.dtype).removeprefix("torch."), "device": str(target.device),
                   **result.to_dict(), "gates": [g.__dict__ for g in gates], "passed": not failed})
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
