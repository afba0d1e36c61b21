"""`llmopt quantize MODEL --method gptq|rtn --bits B --group-size G -o DIR`: quantize a model layer by layer
and write a GPTQ checkpoint (or a dense dequantized one)."""

from __future__ import annotations

import json
import time
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Optional

import torch
import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from llmopt.calibration.samples import CalibConfig, calibration_tokens
from llmopt.calibration.self_text import generate_samples, tokens_sha256
from llmopt.calibration.text import SELF, read_texts
from llmopt.cli.common import DeviceOpt, ForceOpt, ShardSizeOpt, JsonOpt, VerboseOpt, emit_json, err, out, settings
from llmopt.device import CALIB_DTYPES, resolve_calib_dtype, resolve_device
from llmopt.errors import InputError
from llmopt.formats.atomic import atomic_output_file
from llmopt.formats.gptq import check_gptq_spec, write_quantized
from llmopt.formats.hf import parse_size
from llmopt.model import open_model
from llmopt.model.source import ModelSource
from llmopt.quant.gptq import GPTQConfig
from llmopt.quant.pipeline import HEAD, LINEARS, BlockResult, LayerReport, QuantizeSpec, quantize_model
from llmopt.quant.rtn import RTNConfig


class Method(str, Enum):
    gptq = "gptq"
    rtn = "rtn"


class Format(str, Enum):
    gptq = "gptq"
    dense = "dense"


def quantize_command(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(help="Source: an HF directory, a .gguf file or a hub id.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Output directory.")],
    method: Annotated[Method, typer.Option("--method", help="gptq (calibrated) or rtn (round to nearest, no data).")] = Method.gptq,
    bits: Annotated[int, typer.Option("--bits", help="Bits per weight: 2-8 (GPTQ checkpoints: 2, 3, 4, 8).")] = 4,
    group_size: Annotated[int, typer.Option("--group-size", help="Columns per scale: >0 per group, -1 per output channel, 0 per tensor (rtn).")] = 128,
    sym: Annotated[bool, typer.Option("--sym/--asym", help="Symmetric grid (no zero point) or asymmetric (zero point per group).")] = True,
    act_order: Annotated[bool, typer.Option("--act-order", help="GPTQ: quantize columns by decreasing activation energy (desc_act).")] = False,
    group_aware: Annotated[Optional[bool], typer.Option("--group-aware-order/--no-group-aware-order", help="GPTQ: act-order inside contiguous groups (GPTQModel's act_group_aware; no g_idx). On by default with groups, unless --act-order or --static-groups.", show_default=False)] = None,
    static_groups: Annotated[bool, typer.Option("--static-groups", help="GPTQ: choose group scales before quantizing (keeps groups contiguous under --act-order).")] = False,
    damp: Annotated[float, typer.Option("--damp", help="GPTQ: dampening, a fraction of the mean Hessian diagonal (raised automatically if needed).")] = 0.01,
    mse: Annotated[bool, typer.Option("--mse", help="Search a clipping range per group instead of min/max.")] = False,
    refit_scales: Annotated[bool, typer.Option("--refit-scales", help="GPTQ: re-solve each group's scale for the final codes (least squares on the layer's output error).")] = False,
    gptaq: Annotated[float, typer.Option("--gptaq", help="GPTQ: pull each layer toward the full-precision model's output (GPTAQ / GPTQ v2), strength in (0, 1]; 0 = off.")] = 0.0,
    calib: Annotated[Optional[str], typer.Option("--calib", help="Calibration text: a .txt/.jsonl/.parquet file, a preset (wikitext2, c4, pileval; online), or 'self' (model-generated, the default).")] = None,
    calib_field: Annotated[Optional[str], typer.Option("--calib-field", help="Text field of .jsonl/.parquet records [default: text].")] = None,
    nsamples: Annotated[int, typer.Option("--nsamples", help="Calibration samples.")] = 128,
    seqlen: Annotated[int, typer.Option("--seqlen", help="Tokens per calibration sample.")] = 512,
    seed: Annotated[int, typer.Option("--seed", help="Seed for sampling windows (and for --calib self).")] = 0,
    calib_dtype: Annotated[str, typer.Option("--calib-dtype", help=f"GPTQ: dtype of the calibration forward ({' | '.join(CALIB_DTYPES)}); auto = bfloat16 where the device has it natively, else float32. Hessians and weights stay float32.")] = "auto",
    fmt: Annotated[Format, typer.Option("--format", help="gptq: packed GPTQ checkpoint; dense: dequantized float16 weights.")] = Format.gptq,
    quantize_head: Annotated[bool, typer.Option("--quantize-head", help="Quantize the LM head too (embeddings and norms never are).")] = False,
    report: Annotated[Optional[Path], typer.Option("--report", help="Write per-layer error metrics as JSON to this file.")] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Calibration samples per forward pass.")] = 8,
    max_shard_size: ShardSizeOpt = "5GB",
    force: ForceOpt = False,
    json_out: JsonOpt = False,
    device: DeviceOpt = None,
    verbose: VerboseOpt = 0,
) -> None:
    """Quantize a model's linear layers one decoder block at a time (RTN or GPTQ) and write a checkpoint."""
    opts = settings(ctx, json_out, device, verbose)
    dev = resolve_device(opts.device)
    shard_bytes = parse_size(max_shard_size)
    _check_output(output, force)
    if report is not None and report.expanduser().is_dir():
        raise InputError(f"--report {report}: is a directory")
    if method == Method.rtn and calib_dtype != "auto":
        raise InputError("--calib-dtype applies to --method gptq; rtn runs no calibration forward")
    spec = build_spec(method.value, bits, group_size, sym, act_order, static_groups, damp, mse, fmt.value, quantize_head, batch_size,
                      refit_scales=refit_scales, gptaq=gptaq, group_aware=group_aware,
                      act_dtype=resolve_calib_dtype(calib_dtype, dev))
    start = time.perf_counter()
    with open_model(model) as source:
        check_shapes(source, spec)
        calib_cfg = CalibConfig(calib or SELF, calib_field, nsamples, seqlen, seed)
        tokens, calib_info = (None, None)
        if method == Method.gptq:
            tokens, calib_info = load_calibration(source, calib_cfg, dev, show=not opts.json, dtype=spec.act_dtype)
        elif calib is not None:
            raise InputError("--calib applies to --method gptq; rtn needs no data")
        provenance: dict[str, Any] = {"method": method.value, "calibration": calib_info}
        if spec.gptq is not None:
            g = spec.gptq
            provenance["gptq"] = {"damp": g.damp, "act_order": g.act_order, "group_aware_order": g.group_aware,
                                  "static_groups": g.static_groups, "mse": g.mse,
                                  "refit_scales": g.refit_scales, "gptaq": g.fp_target,
                                  "calib_dtype": str(spec.act_dtype).removeprefix("torch.")}
        blocks_total = source.arch.num_layers + (1 if quantize_head else 0)
        reports: list[LayerReport] = []
        timings: list[dict[str, Any]] = []
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      TextColumn("ETA"), TimeRemainingColumn(), console=err, transient=True, disable=opts.json) as progress:
            task = progress.add_task(f"{method.value} w{bits} layer 0/{source.arch.num_layers}", total=blocks_total)

            def on_block(r: BlockResult) -> None:
                reports.extend(r.reports)
                timings.append({"layer": r.layer, "seconds": round(r.seconds, 3)})
                label = "head" if r.layer < 0 else f"layer {r.layer + 1}/{source.arch.num_layers}"
                progress.update(task, advance=1, description=f"{method.value} w{bits} {label} ({r.seconds:.1f}s/layer)")
                if opts.verbose:
                    err.print(f"{label}: {r.seconds:.2f}s")

            final = write_quantized(source, spec, quantize_model(source, spec, tokens, dev), output, fmt.value,
                                    provenance, force, shard_bytes, on_block)
    seconds = time.perf_counter() - start
    summary = {"output": str(final), "format": fmt.value, "method": method.value, "bits": bits,
               "group_size": group_size, "sym": sym, "act_order": act_order, "calibration": calib_info,
               "seconds": round(seconds, 2), "layers": [_layer_row(r) for r in reports], "blocks": timings}
    if report is not None:
        with atomic_output_file(report) as tmp:
            tmp.write_text(json.dumps(summary, indent=2) + "\n")
    if opts.json:
        emit_json(summary)
        return
    out.print(_metrics_table(reports))
    per_layer = sum(t["seconds"] for t in timings) / max(len(timings), 1)
    out.print(f"wrote [bold]{final}[/] ({fmt.value}, {method.value} w{bits} g{group_size} {'sym' if sym else 'asym'}) "
              f"in {seconds:.1f}s ({per_layer:.2f}s per layer)")


def build_spec(method: str, bits: int, group_size: int, sym: bool, act_order: bool, static_groups: bool,
               damp: float, mse: bool, fmt: str, quantize_head: bool, batch_size: int = 8, *,
               refit_scales: bool = False, gptaq: float = 0.0, group_aware: bool | None = False,
               act_dtype: torch.dtype = torch.float32) -> QuantizeSpec:
    """Validate the options and turn them into the typed configs the algorithms take."""
    if not 2 <= bits <= 8:
        raise InputError(f"--bits {bits}: choose 2 to 8")
    if group_size < -1:
        raise InputError(f"--group-size {group_size}: use a positive size, -1 (per channel) or 0 (per tensor)")
    if group_aware is None:  # GPTQModel's default too: it costs nothing and the format is unchanged
        group_aware = method == "gptq" and group_size > 0 and not (act_order or static_groups)
    zero_min = 1 if fmt == "gptq" and not sym else 0  # GPTQ v1 stores zero-1: a zero of 0 would wrap
    if method == "rtn":
        if act_order or static_groups or refit_scales or gptaq or group_aware:
            raise InputError("--act-order, --group-aware-order, --static-groups, --refit-scales and --gptaq apply to --method gptq")
        spec = QuantizeSpec("rtn", rtn=RTNConfig(bits, group_size, sym, mse, zero_min), quantize_head=quantize_head)
    else:
        if group_size == 0:
            raise InputError("--group-size 0 (per tensor) is for rtn; GPTQ takes -1 or a group size")
        if not 0 <= damp < 1:
            raise InputError(f"--damp {damp}: choose a fraction in [0, 1)")
        if batch_size < 1:
            raise InputError(f"--batch-size {batch_size}: must be positive")
        if group_aware and (act_order or static_groups):
            raise InputError("--group-aware-order is an alternative to --act-order and --static-groups; choose one")
        if not 0 <= gptaq <= 1:
            raise InputError(f"--gptaq {gptaq}: choose a strength in [0, 1] (0 = off)")
        cfg = GPTQConfig(bits, group_size, sym, act_order, static_groups, damp, mse=mse, zero_min=zero_min,
                         refit_scales=refit_scales, fp_target=gptaq, group_aware=group_aware)
        spec = QuantizeSpec("gptq", gptq=cfg, quantize_head=quantize_head, batch_size=batch_size, act_dtype=act_dtype)
    if fmt == "gptq":
        check_gptq_spec(spec)
    return spec


def check_shapes(source: ModelSource, spec: QuantizeSpec) -> None:
    """Every quantized linear must hold at least one whole group. A last, partial group is allowed:
    GPTQ checkpoints store ceil(in/group) groups (GPTQModel writes SmolLM2's 576 inputs at g128 so)."""
    names = [f"model.layers.0.{lin}.weight" for lin in LINEARS]
    if spec.quantize_head:
        names.append("lm_head.weight" if "lm_head.weight" in source.tensors else "model.embed_tokens.weight")
    for name in names:
        if name not in source.tensors:
            raise InputError(f"{source.path}: no tensor {name}; not a decoder llmopt can quantize")
        in_f = source.tensors[name].shape[1]
        if spec.group_size > in_f:
            raise InputError(f"--group-size {spec.group_size} is larger than the {in_f} input features of "
                             f"{name.removesuffix('.weight').replace('model.layers.0.', '')}")


def load_calibration(source: ModelSource, cfg: CalibConfig, device: torch.device, show: bool = True,
                     dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, dict[str, Any]]:
    """Token samples for GPTQ, and what to record about them."""
    info: dict[str, Any] = {"source": cfg.source, "nsamples": cfg.nsamples, "seqlen": cfg.seqlen, "seed": cfg.seed}
    if cfg.nsamples < 1 or cfg.seqlen < 2:
        raise InputError(f"--nsamples {cfg.nsamples} --seqlen {cfg.seqlen}: need at least 1 sample of 2 tokens")
    if cfg.source == SELF:
        if cfg.field is not None:
            raise InputError("--calib-field applies to .jsonl and .parquet files")
        with Progress(TextColumn("generating calibration text"), BarColumn(), TimeRemainingColumn(), console=err,
                      transient=True, disable=not show) as progress:
            task = progress.add_task("self", total=1)
            tokens = generate_samples(source, cfg.nsamples, cfg.seqlen, cfg.seed, device,
                                      on_step=lambda d, t: progress.update(task, completed=d, total=t), dtype=dtype)
        info["sha256"] = tokens_sha256(tokens)
        return tokens, info
    text = read_texts(cfg.source, cfg.field)
    tok = source.tokenizer()
    if tok is None:
        raise InputError(f"{source.path}: the model carries no tokenizer to read calibration text with; use --calib self")
    tokens = calibration_tokens(text, tok.encode, cfg)
    info["sha256"] = text.sha256
    return tokens, info


def _check_output(output: Path, force: bool) -> None:
    target = output.expanduser()
    if target.exists() and not force and not (target.is_dir() and not any(target.iterdir())):
        raise InputError(f"{target}: already exists (use --force to replace it)")
    if not target.resolve().parent.is_dir():
        raise InputError(f"{target.resolve().parent}: output folder does not exist")


def _layer_row(r: LayerReport) -> dict[str, Any]:
    row: dict[str, Any] = {"name": r.name, "shape": list(r.shape), **{k: round(v, 8) if abs(v) != float("inf") else str(v) for k, v in r.metrics.items()}}
    if r.gptq_loss is not None:
        row["gptq_loss"] = round(r.gptq_loss, 6)
        row["damp"] = r.damp
    return row


def _metrics_table(reports: list[LayerReport]) -> Table:
    table = Table(title="Weight error per layer", title_justify="left")
    for col in ("layer", "shape", "MSE", "max abs", "cosine", "SQNR dB"):
        table.add_column(col, justify="left" if col in ("layer", "shape") else "right")
    gptq = any(r.gptq_loss is not None for r in reports)
    if gptq:
        table.add_column("GPTQ loss", justify="right")
    for r in reports:
        m = r.metrics
        row = [r.name.replace("model.layers.", "") if r.name != HEAD else HEAD, "×".join(map(str, r.shape)),
               f"{m['mse']:.3e}", f"{m['max_abs']:.4f}", f"{m['cosine']:.6f}", f"{m['sqnr_db']:.2f}"]
        if gptq:
            row.append("" if r.gptq_loss is None else f"{r.gptq_loss:.4g}")
        table.add_row(*row)
    return table

