"""`imatrix`: llama.cpp's importance matrix (mean x² per input channel of every block linear)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmopt.calibration.imatrix import chunk_tokens, compute_imatrix
from llmopt.calibration.samples import token_stream
from llmopt.calibration.text import read_texts
from llmopt.device import resolve_device
from llmopt.errors import OptionError
from llmopt.formats.atomic import check_output
from llmopt.formats.imatrix import write_imatrix
from llmopt.model import open_model
from llmopt.options import ImatrixOptions

def imatrix(model: str | Path, calib: str, output: str | Path, options: ImatrixOptions | None = None, *,
            force: bool = False, device: str = "auto", on_layer: Callable[[int, int], None] | None = None,
            **kwargs: Any) -> dict[str, Any]:  # fmt: skip
    """Compute the importance matrix of `model` over consecutive `ctx_size`-token chunks of `calib`
    (as llama-imatrix does) and write it in llama.cpp's GGUF format (or its legacy .dat). The options
    (`ImatrixOptions`, or keywords: `chunks`, `ctx_size`, `calib_field`, `output_format`) are declared
    in llmopt/options.py."""
    o = ImatrixOptions.merged(options, kwargs)
    chunks, ctx_size = o.chunks, o.ctx_size
    check_output(Path(output), force)
    dev = resolve_device(device)
    start = time.perf_counter()
    with open_model(model) as source:
        tok = source.tokenizer()
        if tok is None:
            raise OptionError(f"{model}: has no tokenizer to read the calibration text with")
        text = read_texts(calib, o.calib_field)
        limit = None if chunks is None else chunks * ctx_size
        stream = token_stream(text, lambda s: tok.tokenizer.encode(s, add_special_tokens=False).ids, max_tokens=limit)
        bos = tok.token_id(tok.bos_token) if tok.add_bos else None
        tokens = chunk_tokens(stream, ctx_size, chunks, bos)
        result = compute_imatrix(source, tokens, device=dev, dataset=calib, on_layer=on_layer)
    final = write_imatrix(result, Path(output), legacy_dat=o.output_format == "dat")
    return {"output": str(final), "format": o.output_format, "entries": len(result.sums),
            "chunks": result.chunk_count, "chunk_size": result.chunk_size,
            "seconds": round(time.perf_counter() - start, 3)}  # fmt: skip
