"""`llmopt recommend`: which model and format fit a memory budget, and how fast they can run."""

from __future__ import annotations

from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from llmopt.cli.common import JsonOpt, VerboseOpt, emit_json, out, settings
from llmopt.plan.gpus import GIB
from llmopt.plan.recommend import Row


def recommend_command(
    ctx: typer.Context,
    mem: Annotated[Optional[str], typer.Option("--mem", help="Memory per device in GiB (default: the --gpu's).", show_default=False)] = None,
    model: Annotated[Optional[str], typer.Option("--model", help="A preset (e.g. llama-3-70b), GGUF file, HF directory or hub id.", show_default=False)] = None,
    params: Annotated[Optional[str], typer.Option("--params", help="A model size such as 13B, planned with the nearest preset's shape.", show_default=False)] = None,
    context: Annotated[int, typer.Option("--context", help="Tokens of context per sequence.")] = 4096,
    batch: Annotated[int, typer.Option("--batch", help="Sequences served at once.")] = 1,
    kv_dtype: Annotated[str, typer.Option("--kv-dtype", help="KV cache type: f16, bf16, q8_0, q4_0.")] = "f16",
    gpu: Annotated[Optional[str], typer.Option("--gpu", help="A GPU from the catalog (e.g. rtx-4090, h100-80g).", show_default=False)] = None,
    bandwidth: Annotated[Optional[float], typer.Option("--bandwidth", help="Memory bandwidth per device in GB/s (overrides --gpu's).", show_default=False)] = None,
    tp: Annotated[int, typer.Option("--tp", help="Devices to split the model over (tensor parallel).")] = 1,
    use_case: Annotated[Optional[str], typer.Option("--use-case", help="quality | balanced | speed  [default: all three]", show_default=False)] = None,
    json_out: JsonOpt = False,
    verbose: VerboseOpt = 0,
) -> None:
    """Which quantization of which model fits in memory, with exact sizes and speed upper bounds."""
    from llmopt.api.recommend import recommend

    opts = settings(ctx, json_out, None, verbose)
    data = recommend(mem=mem, model=model, params=params, context=context, batch=batch, kv_dtype=kv_dtype, gpu=gpu,
                     bandwidth=bandwidth, tp=tp, use_case=use_case)
    rows = data.pop("rows")
    if opts.json:
        emit_json(data)
        return
    _render(data, rows)


def _gib(n: int | float) -> str:
    return f"{n / GIB:.2f}"


def _render(data: dict[str, Any], rows: list[Row]) -> None:
    b, w = data["budget"], data["workload"]
    where = f"{b['memory_gib_per_device']:g} GiB" + (f" x {b['devices']} devices" if b["devices"] > 1 else "")
    gpu = f", {b['gpu']}" if b["gpu"] else ""
    bw = f", {b['bandwidth_gbs_per_device']:g} GB/s" if b["bandwidth_gbs_per_device"] else ""
    out.print(f"[bold]Budget[/] {where}{gpu}{bw}; context {w['context']}, batch {w['batch']}, KV {w['kv_dtype']}")
    if data["mode"] == "model":
        m = data["models"][0]
        moe = f", {m['experts']} experts ({m['experts_per_token']} per token)" if m["experts"] else ""
        out.print(f"[bold]{m['name']}[/]: {m['parameters'] / 1e9:.2f}B parameters, {m['layers']} layers, "
                  f"{m['heads']}/{m['kv_heads']} heads (KV), head dim {m['head_dim']}{moe}; from {m['origin']}")
        out.print(f"KV cache: {m['kv_cache_bytes']:,} bytes ({_gib(m['kv_cache_bytes'])} GiB)")
    table = Table(title="Candidates (GiB per device)" if data["mode"] == "model" else "Best fitting format per known model",
                  title_justify="left")
    cols = (["model"] if data["mode"] == "presets" else []) + [
        "type", "bits/w", "weights", "KV", "overhead", "total", "headroom", "fits", "decode tok/s ≤", "quality"]
    for c in cols:
        table.add_column(c, justify="left" if c in ("model", "type", "fits", "quality") else "right",
                         no_wrap=c in ("model", "type", "quality"))
    picked = {(p["model"], p["format"]) for p in data["recommendations"].values()}
    for r in rows:
        style = "bold green" if (r.model, r.format) in picked else ("dim" if r.fits == "no" else None)
        cells = ([r.model] if data["mode"] == "presets" else []) + [
            r.format, f"{r.bits_per_weight:.2f}", _gib(r.weights_bytes), _gib(r.kv_bytes), _gib(r.overhead.total),
            _gib(r.total_bytes), _gib(r.headroom_bytes), r.fits,
            "—" if r.decode_tps is None else f"{r.decode_tps:.1f}", r.quality.label]
        table.add_row(*cells, style=style)
    wide = out if out.is_terminal else Console(highlight=False, width=132)  # pipes and logs get the full table
    wide.print(table)
    if rows and data["mode"] == "model":
        o = rows[0].overhead
        out.print(f"overhead = activations {_gib(o.activations)} + logits {_gib(o.logits)} + device context "
                  f"{_gib(o.device_context)} GiB")
    for uc, p in data["recommendations"].items():
        out.print(f"[bold green]{uc}[/]: {p['reason']}")
    auto = data.get("automatic")
    if auto is not None:
        out.print(f"[bold green]automatic[/]: a GGUF mix of {auto['target_size_bytes']:,} bytes "
                  f"({auto['bits_per_weight']:.2f} bits/weight) fills the budget; the least predicted KL at that size:")
        out.print(f"  {auto['command']}", soft_wrap=True)
    if not data["recommendations"]:
        out.print("[bold red]nothing fits[/]")
        for n in data["nearest"]:
            out.print(f"  nearest ({n['kind']}): {n['text']}")
    for note in data["notes"]:
        out.print(f"[dim]{note}[/]")
