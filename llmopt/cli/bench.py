"""`llmopt bench MODEL [--engine llmopt|llama.cpp] | --endpoint URL`: TTFT, TPOT, prefill and decode
tokens/s, weight bytes read per second against the bandwidth roofline, peak memory; swept over
prompt length and batch size (or a server's concurrency)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.table import Table

from llmopt.cli.common import DeviceOpt, JsonOpt, VerboseOpt, emit_json, err, human_bytes, out, settings
from llmopt.cli.signature import with_options
from llmopt.options import BenchOptions


@with_options(BenchOptions)
def bench_command(
    ctx: typer.Context,
    model: Annotated[Optional[str], typer.Argument(help="Model to run: a .gguf file, an HF directory (float, GPTQ or AWQ) or a hub id. With --endpoint: the file or folder the server runs, for its tokenizer.", show_default=False)] = None,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Write a PNG of decode tokens/s and TTFT against batch size.", show_default=False)] = None,
    json_out: JsonOpt = False,
    device: DeviceOpt = None,
    verbose: VerboseOpt = 0,
    **options: Any,
) -> None:
    """Benchmark an engine on synthetic prompts: latency percentiles, throughput, roofline, memory."""
    from llmopt.api.bench import bench  # here, not at the top: `llmopt --help` starts without torch

    opts = settings(ctx, json_out, device, verbose)

    def on_row(row) -> None:  # noqa: ANN001
        load = f"batch {row.batch}" if row.batch is not None else f"concurrency {row.concurrency}"
        err.print(f"prompt {row.prompt_len}, {load}: {row.decode_tok_s or 0:.1f} tok/s", highlight=False)

    report = bench(model, BenchOptions.of(**options), device=opts.device, plot=plot, on_row=None if opts.json else on_row)
    if opts.json:
        emit_json(report.to_dict())
        return
    _print(report)
    if plot is not None:
        out.print(f"wrote [bold]{plot}[/]")


def _ms(d: dict | None, key: str) -> str:
    return "-" if d is None else f"{d[key]:.1f}"


def _print(report) -> None:  # noqa: ANN001
    server = report.engine == "endpoint"
    bits = [f"{report.engine}: {report.model if server else Path(report.model).name}", report.endpoint or report.device]
    if report.threads:
        bits.append(f"{report.threads} threads")
    if report.weight_bytes:
        bits.append(f"weights {human_bytes(report.weight_bytes)}")
    if report.bandwidth_gbs:
        bits.append(f"bandwidth {report.bandwidth_gbs:.1f} GB/s ({report.bandwidth_source})")
    table = Table(title="; ".join(bits))
    if server:  # latencies vary per request: percentiles
        columns = ["prompt", "conc", "ok/sent", "TTFT p50", "p99", "TPOT p50", "p99", "e2e p50", "out tok/s"]
    else:  # one TTFT per lockstep run; TPOT varies per step
        columns = ["prompt", "batch", "TTFT", "TPOT p50", "p90", "p99", "prefill tok/s", "decode tok/s", "weights GB/s",
                   "roofline", "peak mem"]  # fmt: skip
    for col in columns:
        table.add_column(col, justify="right")
    for r in report.rows:
        if server:
            cells = [str(r.prompt_len), str(r.concurrency), f"{r.ok}/{r.requests}", _ms(r.ttft_ms, "p50"),
                     _ms(r.ttft_ms, "p99"), _ms(r.tpot_ms, "p50"), _ms(r.tpot_ms, "p99"), _ms(r.e2e_ms, "p50"),
                     f"{r.decode_tok_s or 0:.1f}"]  # fmt: skip
        else:
            cells = [str(r.prompt_len), str(r.batch), _ms(r.ttft_ms, "p50"), _ms(r.tpot_ms, "p50"), _ms(r.tpot_ms, "p90"),
                     _ms(r.tpot_ms, "p99"), f"{r.prefill_tok_s:.0f}", f"{r.decode_tok_s or 0:.1f}",
                     "-" if r.weight_bytes_per_s is None else f"{r.weight_bytes_per_s / 1e9:.2f}",
                     "-" if r.roofline_fraction is None else f"{100 * r.roofline_fraction:.0f}%",
                     "-" if r.peak_memory_bytes is None else human_bytes(r.peak_memory_bytes)]  # fmt: skip
        table.add_row(*cells)
    out.print(table)
    out.print("TTFT and TPOT in ms; TPOT is the time per output token of each sequence after its first.")
