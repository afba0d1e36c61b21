"""Weight providers: from whatever llmopt can read (HF dirs, GGUF of any type) to a ready `Decoder`.

Float checkpoints load as they are. GGUF weights either stay in their quantized form (gguf_linear.py:
memory is about the file's size; decode steps through compiled products or the int4 kernel, prefill
through rebuilt tiles) or are dequantized into the runtime dtype (torch's dense matmuls, no compile),
read one tensor at a time so that peak memory is the model plus one tensor. By default they stay
quantized only when the dequantized model would not fit comfortably in the device's memory
(`keep_gguf_quantized`); `gguf_quantized` forces either way, and `packed=False` always dequantizes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from llmopt.device import resolve_device
from llmopt.errors import InputError, OptionError
from llmopt.memory import available_memory, return_freed_memory
from llmopt.model import ModelSource, TokenizerInfo, open_model
from llmopt.model.decoder import Decoder, Rotary, hf_to_param_name
from llmopt.model.gguf_file import GGUFSource
from llmopt.model.quantized_dir import PackedDirSource
from llmopt.runtime import group_int
from llmopt.runtime.arena import pack_contiguously
from llmopt.runtime.gguf_linear import (QuantizedEmbedding, kept_quantized, quantized_linear, quantized_table, raw_rows,
                                        stacked)
from llmopt.runtime.int4 import PackedInt4Linear, packable
from llmopt.runtime.row_major import fuse_shared_inputs, use_row_major_linears
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


def load_model(spec: str, dtype: str = "auto", device: str = "auto", packed: bool = True,
               gguf_quantized: bool | None = None) -> LoadedModel:
    """Open `spec` and build the runtime model on `device` in `dtype` (`packed`, `gguf_quantized`: see
    build_decoder)."""
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    with open_model(spec) as source:
        model = build_decoder(source, dt, dev, packed, gguf_quantized)
        tok = source.tokenizer()
        return LoadedModel(model, tok, source.kind, str(source.path), dt, dev)


def build_decoder(source: ModelSource, dtype: torch.dtype, device: torch.device, packed: bool = True,
                  gguf_quantized: bool | None = None) -> Decoder:
    """Float sources: in the dtype. GGUF with `packed`: weights stay quantized (gguf_linear.py)
    when `gguf_quantized` says so (None: when `keep_gguf_quantized`); otherwise dequantized into the dtype.
    GPTQ and AWQ with `packed`: layers stay packed (a bfloat16 model's 4-bit ones on the int4 kernel, the
    others as bit planes) where their shapes allow, the rest is dequantized layer by layer. On CPU, float linears
    take the row-major layout that streams weights fastest (see row_major.py), and the weights then
    move into one contiguous block (arena.py)."""
    if isinstance(source, PackedDirSource):
        model = _packed_decoder(source, dtype, device, packed)
    elif packed and isinstance(source, GGUFSource) and (
            keep_gguf_quantized(source, dtype, device) if gguf_quantized is None else gguf_quantized):
        model = _gguf_decoder(source, dtype, device)
    elif source.quantization_config:
        method = source.quantization_config.get("quant_method", "quantized")
        raise InputError(f"{source.path}: {method} checkpoints are not supported by the runtime")
    else:
        model = Decoder.from_source(source, dtype, device)
    if device.type != "cpu":
        return model
    if isinstance(model.lm_head, nn.Linear) and isinstance(model.embed_tokens, nn.Embedding):
        model = use_row_major_linears(model)  # it shares a tied head's float weight with the lookup
    pack_contiguously(model)
    return model


def gguf_quantized_for(keep_quantized: bool, compile: bool) -> bool | None:
    """`build_decoder`'s `gguf_quantized` for a command's flags: True when asked, or when the decode step is
    compiled (it pays on quantized weights, gguf_gemv's products traced in, not on float ones); None
    otherwise, which leaves the choice to `keep_gguf_quantized`."""
    return True if keep_quantized or compile else None


def keep_gguf_quantized(source: GGUFSource, dtype: torch.dtype, device: torch.device) -> bool:
    """Keep a GGUF model quantized in memory when dequantized it would take more than half the memory
    available now on `device`; above that, quantized is what lets a 7B Q4 file run on a small machine
    (or a 70B Q4 file on one GPU) at all.
    Below it, dequantized weights start and prefill faster, which a short run feels most: SmolLM2
    Q4_0 kept quantized decoded at 34-45 tok/s against 18.6-20.3, but prefilled 256 tokens in 0.7-1.0 s
    against 0.45 s, and its first step compiled the products for 5 s (29 s with inductor's disk
    cache cold). `generate --keep-quantized` or `--compile` keeps it quantized anyway."""
    elements = sum(math.prod(info.shape) for info in source.tensors.values())
    return elements * dtype.itemsize > device_memory(device) // 2


def device_memory(device: torch.device) -> int:
    """Bytes free for the model: the system's available memory on CPU, the GPU's free memory on CUDA."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return available_memory()


def _packed_decoder(source: PackedDirSource, dtype: torch.dtype, device: torch.device, packed: bool) -> Decoder:
    arch = source.arch
    with torch.device("meta"):
        model = Decoder(arch)
    kept: dict[str, tuple[QuantizedTensor, Callable]] = {}  # with what builds its module: int4 kernel, bit planes
    state = {}
    for name in source.tensors:
        module = name.removesuffix(".weight")
        if packed and name.endswith(".weight") and module in source.modules:
            qt = source.quantized(module)
            if packable(qt, device, dtype):
                kept[hf_to_param_name(module)] = (qt, lambda q, bias: PackedInt4Linear.from_quantized(q, bias, device))
                continue
            if group_int.kept(qt):  # (built on the CPU, then moved)
                kept[hf_to_param_name(module)] = (qt, lambda q, bias: group_int.GroupIntLinear(q, bias).to(device))
                continue
        state[hf_to_param_name(name)] = source.load(name, dtype=torch.float32).to(device=device, dtype=dtype)
    if "lm_head.weight" not in state and "lm_head" not in kept:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    model.load_state_dict(state, strict=False, assign=True)
    for path, (qt, build) in kept.items():
        _replace(model, path, build(qt, model.get_submodule(path).bias))
    fuse_shared_inputs(model, stacked)  # bit planes of one layout (the float linears fuse later)
    return _finished(model, source, device)


def _gguf_decoder(source: GGUFSource, dtype: torch.dtype, device: torch.device) -> Decoder:
    """Every quantized (or F16) 2-D weight becomes a module holding it in that form on `device`; norms,
    biases and F32 tensors load as floats. One tensor is copied out of the file's map at a time."""
    with torch.device("meta"):
        model = Decoder(source.arch)
    kept = [n for n in source.tensors if kept_quantized(source, n)]
    state = {hf_to_param_name(n): source.load(n, dtype=torch.float32).to(device=device, dtype=dtype)
             for n in source.tensors if n not in kept}
    model.load_state_dict(state, strict=False, assign=True)
    if "lm_head.weight" not in source.tensors and "model.embed_tokens.weight" not in kept:
        model.lm_head.weight = model.embed_tokens.weight  # tied, float
    for name in kept:
        qtype, data = raw_rows(source, name)
        path = hf_to_param_name(name).removesuffix(".weight")
        if path == "embed_tokens":
            tied = "lm_head.weight" not in source.tensors  # one quantized table serves both
            if tied:
                model.lm_head = quantized_linear(qtype, data, None, dtype, device)
            shared = tied and hasattr(model.lm_head, "rows")  # (the int4 kernel's packing cannot give rows back)
            model.embed_tokens = QuantizedEmbedding(model.lm_head if shared else quantized_table(qtype, data, device),
                                                    dtype)
        else:
            _replace(model, path, quantized_linear(qtype, data, model.get_submodule(path).bias, dtype, device))
        del data
        source.release_pages()  # copied out: the file's pages need not stay resident
        return_freed_memory()  # nor the temporaries' heap pages
    fuse_shared_inputs(model, stacked, after_each=return_freed_memory)  # the parts' heap pages too
    return _finished(model, source, device)


def _replace(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, child = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def _finished(model: Decoder, source: ModelSource, device: torch.device) -> Decoder:
    """Add the rotary tables; refuse a model with tensors left unloaded."""
    model.rotary = Rotary(model.arch).to(device)
    left = [n for n, p in [*model.named_parameters(), *model.named_buffers()] if p.is_meta]
    if left:
        raise InputError(f"{source.path}: missing tensors {left[:3]}{' ...' if len(left) > 3 else ''}")
    return model.eval()


def set_threads(threads: int) -> None:
    """`--threads N`: fewer threads than cores is faster when other work shares the machine."""
    if threads < 0:
        raise OptionError(f"<threads> must be >= 0, got {threads}")
    if threads:
        torch.set_num_threads(threads)
