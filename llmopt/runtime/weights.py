"""Weight providers: from whatever llmopt can read (HF dirs, GGUF of any type) to a ready `Decoder`.

Float checkpoints load as they are; GGUF tensors are dequantized one at a time by the source, so
peak memory is the model in the runtime dtype plus one tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmopt.device import resolve_device
from llmopt.errors import InputError
from llmopt.model import ModelSource, TokenizerInfo, open_model
from llmopt.model.decoder import Decoder

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` is float32 on CPU (exact, and fast there) and bfloat16 on accelerators."""
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if name not in DTYPES:
        raise InputError(f"bad --dtype {name!r}; choose one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


@dataclass
class LoadedModel:
    model: Decoder
    tokenizer: TokenizerInfo | None
    source_kind: str
    path: str
    dtype: torch.dtype
    device: torch.device


def load_model(spec: str, dtype: str = "auto", device: str = "auto") -> LoadedModel:
    """Open `spec` and build the runtime model on `device` in `dtype`."""
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    with open_model(spec) as source:
        model = build_decoder(source, dt, dev)
        tok = source.tokenizer()
        return LoadedModel(model, tok, source.kind, str(source.path), dt, dev)


def build_decoder(source: ModelSource, dtype: torch.dtype, device: torch.device) -> Decoder:
    qc = source.quantization_config
    if qc:
        raise InputError(f"{source.path}: {qc.get('quant_method', 'quantized')} checkpoints are not supported by the runtime yet")
    return Decoder.from_source(source, dtype, device)


def set_threads(threads: int) -> None:
    """`--threads N`: fewer threads than cores is faster when other work shares the machine."""
    if threads < 0:
        raise InputError(f"--threads must be >= 0, got {threads}")
    if threads:
        torch.set_num_threads(threads)
