"""Weight providers: from whatever llmopt can read (HF dirs, GGUF of any type) to a ready `Decoder`.

Float checkpoints load as they are; GGUF tensors are dequantized one at a time by the source, so
peak memory is the model in the runtime dtype plus one tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmopt.device import resolve_device
from llmopt.errors import InputError, OptionError
from llmopt.model import ModelSource, TokenizerInfo, open_model
from llmopt.model.decoder import Decoder, Rotary, hf_to_param_name
from llmopt.model.quantized_dir import PackedDirSource
from llmopt.runtime.arena import pack_contiguously
from llmopt.runtime.int4 import PackedInt4Linear, packable
from llmopt.runtime.row_major import use_row_major_linears
from llmopt.quantized_tensor import QuantizedTensor

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` is float32 on CPU (exact, and fast there) and bfloat16 on accelerators."""
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if name not in DTYPES:
        raise OptionError(f"bad <dtype> {name!r}; choose one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


@dataclass
class LoadedModel:
    model: Decoder
    tokenizer: TokenizerInfo | None
    source_kind: str
    path: str
    dtype: torch.dtype
    device: torch.device


def load_model(spec: str, dtype: str = "auto", device: str = "auto", packed: bool = True) -> LoadedModel:
    """Open `spec` and build the runtime model on `device` in `dtype` (`packed`: see build_decoder)."""
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    with open_model(spec) as source:
        model = build_decoder(source, dt, dev, packed)
        tok = source.tokenizer()
        return LoadedModel(model, tok, source.kind, str(source.path), dt, dev)


def build_decoder(source: ModelSource, dtype: torch.dtype, device: torch.device, packed: bool = True) -> Decoder:
    """Float and GGUF sources: dequantized into the dtype. GPTQ and AWQ: 4-bit layers stay packed where the
    int4 kernel applies (`packed`), the rest is dequantized layer by layer. On CPU, float linears
    take the row-major layout that streams weights fastest (see row_major.py), and the weights then
    move into one contiguous block (arena.py)."""
    if isinstance(source, PackedDirSource):
        model = _packed_decoder(source, dtype, device, packed)
    elif source.quantization_config:
        method = source.quantization_config.get("quant_method", "quantized")
        raise InputError(f"{source.path}: {method} checkpoints are not supported by the runtime")
    else:
        model = Decoder.from_source(source, dtype, device)
    if device.type != "cpu":
        return model
    model = use_row_major_linears(model)
    pack_contiguously(model)
    return model


def _packed_decoder(source: PackedDirSource, dtype: torch.dtype, device: torch.device, packed: bool) -> Decoder:
    arch = source.arch
    with torch.device("meta"):
        model = Decoder(arch)
    kept: dict[str, QuantizedTensor] = {}
    state = {}
    for name in source.tensors:
        module = name.removesuffix(".weight")
        if packed and name.endswith(".weight") and module in source.modules:
            qt = source.quantized(module)
            if packable(qt, device):
                kept[hf_to_param_name(module)] = qt
                continue
        state[hf_to_param_name(name)] = source.load(name, dtype=torch.float32).to(device=device, dtype=dtype)
    if "lm_head.weight" not in state and "lm_head" not in kept:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    model.load_state_dict(state, strict=False, assign=True)
    for path, qt in kept.items():
        parent, _, child = path.rpartition(".")
        old = model.get_submodule(path)
        setattr(model.get_submodule(parent) if parent else model, child, PackedInt4Linear(qt, old.bias))
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:
        raise InputError(f"{source.path}: missing tensors {left[:3]}{' ...' if len(left) > 3 else ''}")
    model.rotary = Rotary(arch).to(device)
    return model.eval()


def set_threads(threads: int) -> None:
    """`--threads N`: fewer threads than cores is faster when other work shares the machine."""
    if threads < 0:
        raise OptionError(f"<threads> must be >= 0, got {threads}")
    if threads:
        torch.set_num_threads(threads)
