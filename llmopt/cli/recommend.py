"""`llmopt recommend`: which model and format fit a memory budget, and how fast they can run."""

from __future__ import annotations

import re
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from llmopt.cli.common import JsonOpt, VerboseOpt, emit_json, out, settings
from llmopt.errors import InputError
from llmopt.plan.gpus import GIB, get_gpu
from llmopt.plan.kv_cache import check_kv_dtype
from llmopt.plan.models import PlanModel, from_params, parse_params, resolve_model
from llmopt.plan.recommend import USE_CASES, Budget, Row, Workload, recommend_for_model, recommend_over_presets, tp_allowed

_MEM = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(gib|gb|g)?\s*$", re.IGNORECASE)


def parse_mem(text: str) -> int:
    """"48", "48GB", "48GiB" -> bytes. GPU memory is sold in GiB ("24 GB" cards hold 24 GiB)."""
    m = _MEM.match(text)
    if not m or float(m.group(1)) <= 0:
        raise InputError(f"bad --mem {text!r}: give a positive memory size in GiB, such as 24 or 80GB")
    return int(float(m.group(1)) * GIB)


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
    opts = settings(ctx, json_out, None, verbose)
    gpu_spec = get_gpu(gpu) if gpu else None
    if mem is None and gpu_spec is None:
        raise InputError("give --mem (GiB per device) or --gpu (its memory is used)")
    memory = parse_mem(mem) if mem is not None else gpu_spec.memory_bytes
    if bandwidth is not None and not bandwidth > 0:
        raise InputError(f"bad --bandwidth {bandwidth}: give a positive GB/s figure")
    for name, value in (("--context", context), ("--batch", batch), ("--tp", tp)):
        if value < 1:
            raise InputError(f"bad {name} {value}: must be at least 1")
    use_cases = USE_CASES
    if use_case is not None:
        if use_case.lower() not in USE_CASES:
            raise InputError(f"unknown --use-case {use_case!r}; choose one of: {', '.join(USE_CASES)}")
        use_cases = (use_case.lower(),)
    if model and params:
        raise InputError("give --model or --params, not both")
    workload = Workload(context=context, batch=batch, kv_dtype=check_kv_dtype(kv_dtype), tp=tp)
    budget = Budget(memory, gpu_spec, bandwidth)

    plan_model = resolve_model(model) if model else from_params(parse_params(params)) if params else None
    if plan_model is not None:
        if not tp_allowed(plan_model, tp):
            raise InputError(f"--tp {tp} does not divide {plan_model.name}'s {plan_model.arch.num_heads} heads "
                             f"/ {plan_model.arch.num_kv_heads} KV heads")
        result = recommend_for_model(plan_model, workload, budget, use_cases)
    else:
        result = recommend_over_presets(workload, budget, use_cases)
    data = _to_json(result, workload, budget, plan_model)
    if opts.json:
        emit_json(data)
        return
    _render(data, result["candidates"])


def _to_json(result: dict[str, Any], workload: Workload, budget: Budget, model: PlanModel | None) -> dict[str, Any]:
    notes = ["decode tokens/s and prefill seconds are rooflines (bandwidth and compute upper bounds), not predictions",
             "memory is per device: weights (split over --tp devices) + KV cache + activations + logits + device context"]
    if model is not None and workload.context > model.arch.max_position_embeddings:
        notes.append(f"--context {workload.context} exceeds {model.name}'s trained context of "
                     f"{model.arch.max_position_embeddings} tokens")
    if budget.device(1) is None:
        notes.append("no --gpu or --bandwidth: speed columns are empty")
    return {
        "mode": result["mode"],
        "budget": {"memory_bytes_per_device": budget.memory_bytes, "memory_gib_per_device": round(budget.memory_bytes / GIB, 3),
                   "gpu": budget.gpu.name if budget.gpu else None,
                   "bandwidth_gbs_per_device": budget.bandwidth_gbs or (budget.gpu.bandwidth_gbs if budget.gpu else None),
                   "devices": workload.tp},
        "workload": {"context": workload.context, "batch": workload.batch, "kv_dtype": workload.kv_dtype},
        "models": result["models"],
        "candidates": [r.to_dict() for r in result["candidates"]],
        "recommendations": result["recommendations"],
        "nearest": result["nearest"],
        "notes": notes,
    }  # fmt: skip


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
    if not data["recommendations"]:
        out.print("[bold red]nothing fits[/]")
        for n in data["nearest"]:
            out.print(f"  nearest ({n['kind']}): {n['text']}")
    for note in data["notes"]:
        out.print(f"[dim]{note}[/]")
