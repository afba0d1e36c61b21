"""`llmopt imatrix MODEL --calib TEXT -o imatrix.gguf`: llama.cpp's importance matrix, computed in PyTorch."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from llmopt.cli.common import DeviceOpt, ForceOpt, JsonOpt, VerboseOpt, emit_json, err, out, settings
from llmopt.device import resolve_device
from llmopt.errors import InputError
from llmopt.model import open_model


def imatrix_command(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(help="Source: an HF directory, a .gguf file or a hub id.")],
    calib: Annotated[str, typer.Option("--calib", help="Calibration text: .txt/.jsonl/.parquet file or a preset.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Output file (llama.cpp GGUF imatrix format).")],
    chunks: Annotated[Optional[int], typer.Option("--chunks", help="Use at most this many chunks.")] = None,
    ctx_size: Annotated[int, typer.Option("--ctx-size", "-c", help="Tokens per chunk (llama-imatrix's -c).")] = 512,
    field: Annotated[Optional[str], typer.Option("--field", help="Text field of .jsonl/.parquet records.")] = None,
    output_format: Annotated[str, typer.Option("--output-format", help="gguf (default) or dat (legacy).")] = "gguf",
    force: ForceOpt = False,
    json_out: JsonOpt = False,
    device: DeviceOpt = None,
    verbose: VerboseOpt = 0,
) -> None:
    """Compute the mean of x² per input channel of every block linear over calibration text."""
    from llmopt.calibration.imatrix import chunk_tokens, compute_imatrix, write_imatrix
    from llmopt.calibration.samples import token_stream
    from llmopt.calibration.text import read_texts

    opts = settings(ctx, json_out, device, verbose)
    if output_format not in ("gguf", "dat"):
        raise InputError(f"--output-format {output_format!r}: choose gguf or dat")
    if output.exists() and not force:
        raise InputError(f"{output}: already exists (use --force to replace it)")
    if ctx_size < 16:
        raise InputError("--ctx-size must be at least 16 (llama.cpp ignores smaller batches)")
    start = time.perf_counter()
    with open_model(model) as source:
        tok = source.tokenizer()
        if tok is None:
            raise InputError(f"{model}: has no tokenizer to read the calibration text with")
        text = read_texts(calib, field)
        limit = None if chunks is None else chunks * ctx_size
        stream = token_stream(text, lambda s: tok.tokenizer.encode(s, add_special_tokens=False).ids, max_tokens=limit)
        bos = tok.token_id(tok.bos_token) if tok.add_bos else None
        tokens = chunk_tokens(stream, ctx_size, chunks, bos)
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=err, transient=True) as progress:  # fmt: skip
            task = progress.add_task(f"imatrix over {tokens.shape[0]}×{ctx_size} tokens", total=source.arch.num_layers)
            result = compute_imatrix(source, tokens, device=resolve_device(opts.device), dataset=calib,
                                     on_layer=lambda done, total: progress.update(task, completed=done))  # fmt: skip
    final = write_imatrix(result, output, legacy_dat=output_format == "dat")
    seconds = time.perf_counter() - start
    summary = {"output": str(final), "format": output_format, "entries": len(result.sums),
               "chunks": result.chunk_count, "chunk_size": result.chunk_size, "seconds": round(seconds, 3)}  # fmt: skip
    if opts.json:
        emit_json(summary)
    else:
        out.print(f"wrote [bold]{final}[/] ({len(result.sums)} entries, {result.chunk_count} chunks × "
                  f"{result.chunk_size} tokens) in {seconds:.1f}s")  # fmt: skip
