"""`imatrix`: llama.cpp's importance matrix (mean x² per input channel of every block linear)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from llmopt.api.budget import check_memory, dry_run
from llmopt.calibration.imatrix import chunk_tokens, compute_imatrix
from llmopt.calibration.samples import CalibConfig, load_calibration, token_stream
from llmopt.calibration.text import SELF, read_texts
from llmopt.device import resolve_calib_dtype, resolve_device
from llmopt.errors import OptionError
from llmopt.formats.atomic import check_output
from llmopt.formats.imatrix import write_imatrix
from llmopt.model import ModelSource, open_model
from llmopt.options import ImatrixOptions
from llmopt.plan.footprint import Workload


def imatrix(model: str | Path, calib: str, output: str | Path, options: ImatrixOptions | None = None, *,
            force: bool = False, device: str = "auto", on_layer: Callable[[int, int], None] | None = None,
            **kwargs: Any) -> dict[str, Any]:  # fmt: skip
    """Compute the importance matrix of `model` over consecutive `ctx_size`-token chunks of `calib`
    (as llama-imatrix does) and write it in llama.cpp's GGUF format (or its legacy .dat). The options
    (`ImatrixOptions`, or keywords: `chunks`, `ctx_size`, `calib_field`, `output_format`) are declared
    in llmopt/options.py."""
    o = ImatrixOptions.merged(options, kwargs)
    check_output(Path(output), force)
    dev = resolve_device(device)
    start = time.perf_counter()
    with open_model(model) as source:
        tokens = _chunks(source, model, calib, o, generate_on=dev)
        check_memory(source.arch, [_workload(tokens)])
        result = compute_imatrix(source, tokens, device=dev, dataset=calib, on_layer=on_layer)
    final = write_imatrix(result, Path(output), legacy_dat=o.output_format == "dat")
    return {"output": str(final), "format": o.output_format, "entries": len(result.sums),
            "chunks": result.chunk_count, "chunk_size": result.chunk_size,
            "seconds": round(time.perf_counter() - start, 3)}  # fmt: skip


def plan_imatrix(model: str | Path, calib: str, options: ImatrixOptions | None = None, **kwargs: Any) -> dict[str, Any]:
    """What `imatrix` would hold and take (`--dry-run`): its chunks, its footprint, its estimated time."""
    o = ImatrixOptions.merged(options, kwargs)
    with open_model(model) as source:
        return dry_run(source.arch, [_workload(_chunks(source, model, calib, o))])


def _chunks(source: ModelSource, model: str | Path, calib: str, o: ImatrixOptions,
            generate_on: torch.device | None = None) -> torch.Tensor:  # fmt: skip
    """The calibration text as llama-imatrix chunks it: [chunks, ctx_size] token ids. `self`: the
    samples `quantize --calib self --seed 0` takes (its default --nsamples rows unless --chunks, written in
    the calibration dtype of `generate_on`; zeros of their shape for a dry run)."""
    if calib == SELF:
        cfg = CalibConfig(SELF, o.calib_field, o.chunks or CalibConfig.nsamples, o.ctx_size, seed=0)
        if generate_on is None:
            return torch.zeros(cfg.nsamples, cfg.seqlen, dtype=torch.int64)
        return load_calibration(source, cfg, generate_on, resolve_calib_dtype("auto", generate_on))[0]
    tok = source.tokenizer()
    if tok is None:
        raise OptionError(f"{model}: has no tokenizer to read the calibration text with")
    text = read_texts(calib, o.calib_field)
    limit = None if o.chunks is None else o.chunks * o.ctx_size
    stream = token_stream(text, lambda s: tok.tokenizer.encode(s, add_special_tokens=False).ids, max_tokens=limit)
    bos = tok.token_id(tok.bos_token) if tok.add_bos else None
    return chunk_tokens(stream, o.ctx_size, o.chunks, bos)


def _workload(tokens: torch.Tensor) -> Workload:
    return Workload("imatrix", samples=int(tokens.shape[0]), seqlen=int(tokens.shape[1]), batch=1)
