"""`llmopt inspect PATH`: architecture, size, types, tokenizer and metadata of any readable model."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table

from llmopt.cli.common import DeviceOpt, JsonOpt, VerboseOpt, emit_json, human_bytes, human_count, out, settings


def inspect_command(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(help="HF model directory, .gguf file, or hub id (org/name).")],
    tensors: Annotated[bool, typer.Option("--tensors", help="List every tensor: name, shape, type, bytes.")] = False,
    json_out: JsonOpt = False,
    device: DeviceOpt = None,
    verbose: VerboseOpt = 0,
) -> None:
    """Summarize a model: architecture, parameters, tensor types, bits per weight, tokenizer, metadata."""
    from llmopt.api.inspect import inspect  # here, not at the top: `llmopt --help` starts without torch

    opts = settings(ctx, json_out, device, verbose)
    info = inspect(model, tensors=tensors)
    if opts.json:
        emit_json(info)
        return
    _render(info)


def _kv_table(title: str, rows: dict[str, Any]) -> Table:
    table = Table(title=title, title_justify="left", show_header=False, box=None, padding=(0, 2))
    table.add_column(style="bold cyan")
    table.add_column()
    for k, v in rows.items():
        table.add_row(k, str(v))
    return table


def _render(info: dict[str, Any]) -> None:
    a = info["architecture"]
    out.print(f"[bold]{info['path']}[/]  ({info['format']})")
    out.print(_kv_table("Architecture", {
        "family": f"{a['family']} ({a['hf_architecture']})",
        "hidden size": a["hidden_size"], "layers": a["num_layers"],
        "heads / kv heads": f"{a['num_heads']} / {a['num_kv_heads']} (head dim {a['head_dim']})",
        "ffn size": a["intermediate_size"], "vocab": a["vocab_size"], "context": a["max_position_embeddings"],
        "rope theta": a["rope_theta"], "rope scaling": a["rope_scaling"] or "none", "norm eps": a["rms_norm_eps"],
        "tied embeddings": a["tie_word_embeddings"], "q/k/v bias": a["attention_bias"],
        "sliding window": a["sliding_window"] or "none",
    }))
    out.print(_kv_table("Size", {
        "parameters": f"{human_count(info['parameters'])} ({info['parameters']:,})",
        "tensors": info["tensor_count"],
        "weights": f"{human_bytes(info['bytes'])} ({info['bytes']:,} bytes)",
        "bits per weight": info["bits_per_weight"],
    }))
    aside = info.get("not_read")
    if aside:
        out.print(f"[yellow]{aside['model']}: the language model only; its vision tower and projector "
                  f"({aside['tensors']} tensors, {human_count(aside['parameters'])} parameters) are not read[/]")
    types = Table(title="Tensor types", title_justify="left")
    for col in ("type", "tensors", "parameters", "bytes"):
        types.add_column(col, justify="left" if col == "type" else "right")
    for name, row in info["types"].items():
        types.add_row(name, str(row["tensors"]), human_count(row["parameters"]), human_bytes(row["bytes"]))
    out.print(types)
    tok = info["tokenizer"]
    if tok:
        specials = ", ".join(f"{k}={v['token']!r} ({v['id']})" for k, v in tok["special_tokens"].items())
        out.print(_kv_table("Tokenizer", {
            "kind": tok["kind"] + (f" (pre: {tok['pre_tokenizer']})" if tok["pre_tokenizer"] else ""),
            "vocab size": tok["vocab_size"], "special tokens": specials or "none",
            "adds bos / eos": f"{tok['add_bos']} / {tok['add_eos']}", "chat template": tok["chat_template"],
        }))
    else:
        out.print("[yellow]no tokenizer[/]")
    if info["metadata"]:
        out.print(_kv_table("Metadata", {k: v for k, v in info["metadata"].items()}))
    if info["quantization_config"]:
        out.print(_kv_table("quantization_config", info["quantization_config"]))
    if "tensors" in info:
        t = Table(title="Tensors", title_justify="left")
        for col in ("name", "stored as", "shape", "type", "bytes"):
            t.add_column(col, justify="right" if col == "bytes" else "left")
        for row in info["tensors"]:
            stored = "" if row["stored_name"] == row["name"] else row["stored_name"]
            t.add_row(row["name"], stored, "×".join(map(str, row["shape"])), row["type"], f"{row['bytes']:,}")
        out.print(t)
