"""Options that `quantize` and `convert --to gguf` share: the calibrated methods' and the calibration's.
One declaration each, so the two commands cannot drift apart."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from llmopt.names import CALIB_DTYPES

ActOrderOpt = Annotated[bool, typer.Option("--act-order", help="GPTQ: quantize columns by decreasing activation energy (desc_act).")]
GroupAwareOpt = Annotated[Optional[bool], typer.Option("--group-aware-order/--no-group-aware-order", help="GPTQ: act-order inside contiguous groups (GPTQModel's act_group_aware; no g_idx). On by default with groups, unless --act-order or --static-groups.", show_default=False)]
StaticGroupsOpt = Annotated[bool, typer.Option("--static-groups", help="GPTQ: choose group scales before quantizing (keeps groups contiguous under --act-order).")]
DampOpt = Annotated[float, typer.Option("--damp", help="GPTQ: dampening, a fraction of the mean Hessian diagonal (raised automatically if needed).")]
GptaqOpt = Annotated[float, typer.Option("--gptaq", help="GPTQ: pull each layer toward the full-precision model's output (GPTAQ / GPTQ v2), strength in (0, 1]; 0 = off.")]
ClipOpt = Annotated[bool, typer.Option("--clip/--no-clip", help="AWQ: search a clipping range per group (AutoAWQ's); --no-clip skips it.")]
CalibOpt = Annotated[Optional[str], typer.Option("--calib", help="Calibration text: a .txt/.jsonl/.parquet file, a preset (wikitext2, c4, pileval; online), or 'self' (model-generated, the default).")]
CalibFieldOpt = Annotated[Optional[str], typer.Option("--calib-field", help="Text field of .jsonl/.parquet records [default: text].")]
NSamplesOpt = Annotated[int, typer.Option("--nsamples", help="Calibration samples.")]
SeqlenOpt = Annotated[int, typer.Option("--seqlen", help="Tokens per calibration sample.")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seed for sampling windows (and for --calib self).")]
CalibDtypeOpt = Annotated[str, typer.Option("--calib-dtype", help=f"Calibrated methods: dtype of the calibration forward ({' | '.join(CALIB_DTYPES)}); auto = bfloat16 where the device has it natively, else float32. Hessians and weights stay float32.")]
BatchSizeOpt = Annotated[int, typer.Option("--batch-size", help="Calibration samples per forward pass.")]
