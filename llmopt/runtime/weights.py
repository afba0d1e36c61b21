"""Weight providers: from whatever llmopt can read (HF dirs, GGUF of any type) to a ready `Decoder`.

Float checkpoints load as they are. GGUF weights either stay in their quantized form (gguf_linear.py:
memory is about the file's size; decode steps through compiled products or the int4 kernel, prefill
through rebuilt tiles) or are dequantized into the runtime dtype (torch's dense matmuls, no compile),
read one tensor at a time so that peak memory is the model plus one tensor. GPTQ, AWQ and
compressed-tensors layers likewise stay packed (bit planes, torch's int4 kernel in a bfloat16 model) or
are dequantized. One rule for both (`keep_quantized`): on CPU they stay quantized only when the
dequantized model would not fit comfortably in memory; `quantized` forces either way.

Every source, float, GGUF or packed GPTQ/AWQ, is assembled by one routine (`assemble`); which module a
stored weight becomes is decided by runtime/linear.py's registry alone.
"""

from __future__ import annotations

from collections.abc import Hashable
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
from llmopt.model.ggml_types import GGMLQuantType
from llmopt.runtime.arena import pack_contiguously
from llmopt.runtime.gguf_linear import QuantizedEmbedding, raw_rows, stacked
from llmopt.runtime.linear import RowSource, Weight, has_module, quantized_module
from llmopt.runtime.row_major import fuse_shared_inputs, half_products, use_row_major_linears

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


def load_model(spec: str, dtype: str = "auto", device: str = "auto", quantized: bool | None = None,
               decode: bool = False) -> LoadedModel:
    """Open `spec` and build the runtime model on `device` in `dtype` (`quantized`: see build_decoder);
    `decode`: for generating (not scoring), where `half_weights` may hold the float linears in float16."""
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    with open_model(spec) as source:
        half = decode and dtype == "auto" and half_weights(source, dev)
        model = build_decoder(source, dt, dev, quantized, half=half)
        tok = source.tokenizer()
        return LoadedModel(model, tok, source.kind, str(source.path), dt, dev)


def check_readable(source: ModelSource) -> None:
    """Refuse a checkpoint quantized by a method llmopt does not read (its tensors would read as floats)."""
    if source.quantization_config and not isinstance(source, PackedDirSource):
        method = source.quantization_config.get("quant_method", "quantized")
        raise InputError(f"{source.path}: {method} checkpoints are not supported by the runtime")


def half_weights(source: ModelSource, device: torch.device) -> bool:
    """Whether a decoding model's float linears (float32 model, `--dtype auto`, CPU) hold their weights in
    float16 (row_major.HalfLinear): where no 2-D tensor of the file is stored in float32 (a float32
    checkpoint keeps its weights exact; F16 ones are held exactly, BF16 ones exactly but below float16's
    normal range, dequantized ones rounded to float16, 2^-11 relative) and torch's CPU kernels are
    vectorized. Decode streams half the bytes: SmolLM2 F16 27.9 -> 48.1 tok/s. A prompt's rows stay float32
    arithmetic, W widened tile by tile, but 27-46% slower than oneDNN's reordered float32 weights, so
    `eval` (prompts only) does not load this way (docs/bench.md)."""
    return device.type == "cpu" and half_products() and not any(
        info.dtype in ("F32", "F64") for info in source.tensors.values() if len(info.shape) == 2)


def build_decoder(source: ModelSource, dtype: torch.dtype, device: torch.device,
                  quantized: bool | None = None, half: bool = False) -> Decoder:
    """Float tensors load in the dtype. A weight stored in a form the registry knows (runtime/linear.py:
    GPTQ, AWQ and compressed-tensors layers, GGUF types) stays in it where `quantized` says so (None:
    `keep_quantized` decides) and a candidate fits (a bfloat16 model's 4-bit layers on the int4 kernel, the
    other packed layers as bit planes, GGUF in its type's fields); otherwise it is dequantized. On CPU, float
    linears take the row-major layout that streams weights fastest (see row_major.py; with `half`, their
    weights held in float16), and the weights then move into one contiguous block (arena.py)."""
    check_readable(source)
    keep = keep_quantized(source, dtype, device) if quantized is None else quantized
    model = assemble(source, dtype, device, keep, half_linears=half and not keep)
    if device.type != "cpu":
        return model
    if isinstance(model.lm_head, nn.Linear) and isinstance(model.embed_tokens, nn.Embedding):
        model = use_row_major_linears(model, half=half)  # it shares a tied head's float weight with the lookup
    pack_contiguously(model)
    return model


def keep_quantized(source: ModelSource, dtype: torch.dtype, device: torch.device) -> bool:
    """Keep a quantized model (GGUF, or a GPTQ/AWQ/compressed-tensors checkpoint) quantized in memory when
    dequantized it would take more than half the memory available now on `device`: that is what lets a 7B
    Q4 file run on a small machine (or a 70B one on one GPU) at all. Below it, on CPU, dequantized weights
    start, prefill and (without --compile) decode at least as fast: SmolLM2 Q4_0 kept quantized decoded at
    34-45 tok/s against 18.6-20.3 but prefilled 256 tokens in 0.7-1.0 s against 0.45 s and compiled its
    products for 5 s at the first step (29 s with inductor's disk cache cold); SmolLM2 GPTQ w4 g128 as bit
    planes generated 32 tokens at 9.1 tok/s (the compile inside), dequantized at 24.7. On CUDA a packed
    checkpoint stays packed: its 4-bit layers are what tinygemm's int4 kernel reads."""
    if device.type == "cuda" and isinstance(source, PackedDirSource):
        return True
    return source.parameter_count * dtype.itemsize > device_memory(device) // 2


def device_memory(device: torch.device) -> int:
    """Bytes free for the model: the system's available memory on CPU, the GPU's free memory on CUDA."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return available_memory()


def assemble(source: ModelSource, dtype: torch.dtype, device: torch.device, keep: bool,
             half_linears: bool = False) -> Decoder:
    """The one decoder assembly. Float tensors load as floats; with `keep`, each weight stored in a form the
    registry knows is asked for its module (`_place`), one at a time, the file's pages and the temporaries'
    heap pages handed back after each; then linears that read one input are stacked. `half_linears` (every
    weight loaded as floats, to become HalfLinears): the linears' weights, a tied head's table included, are
    read straight into float16, so the load never holds them in float32."""
    with torch.device("meta"):
        model = Decoder(source.arch)
    tied = head_tied(source)
    halved = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Linear)} if half_linears else set()
    if halved and tied:
        halved.add("embed_tokens.weight")
    stored = {n: f for n in source.tensors if keep and has_module(f := stored_form(source, n))}
    state = {p: _float(source, n, torch.float16 if p in halved else dtype, device)
             for n in source.tensors if n not in stored for p in [hf_to_param_name(n)]}
    if tied and "embed_tokens.weight" in state:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    model.load_state_dict(state, strict=False, assign=True)
    for name, form in stored.items():
        _place(model, source, name, form, dtype, device, tied)
        source.release_pages()  # copied out: the file's pages need not stay resident
        return_freed_memory()  # nor the temporaries' heap pages
    fuse_shared_inputs(model, stacked, after_each=return_freed_memory)  # the parts' heap pages too
    return _finished(model, source, device)


def head_tied(source: ModelSource) -> bool:
    """Whether the LM head reads the embedding table: when the source holds no head, or a float checkpoint's
    config says tied (as transformers loads it). A packed checkpoint's own head stays its own (it may be
    quantized while the config still says tied)."""
    return "lm_head.weight" not in source.tensors or (
        source.arch.tie_word_embeddings and not isinstance(source, PackedDirSource))


def stored_form(source: ModelSource, name: str) -> Hashable | None:
    """The registry's key for HF tensor `name` where it is a linear's weight stored quantized: its GGUF type
    (a 2-D weight), or a packed checkpoint's method for its packed layers; None for a float tensor."""
    if not name.endswith(".weight"):
        return None
    if isinstance(source, GGUFSource):
        return GGMLQuantType[source.tensors[name].dtype] if len(source.tensors[name].shape) == 2 else None
    if isinstance(source, PackedDirSource) and name.removesuffix(".weight") in source.modules:
        return source.method
    return None


def _stored_weight(source: ModelSource, name: str) -> Weight:
    """A GGUF weight's block bytes (rows in HF order), or a packed layer as a QuantizedTensor."""
    if isinstance(source, GGUFSource):
        return raw_rows(source, name)[1]
    return source.quantized(name.removesuffix(".weight"))


def _float(source: ModelSource, name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Tensor `name` dequantized (or read) in float32, then in the model's dtype on `device`. A GGUF weight whose
    block type has a module that gives rows back is rebuilt by it, in torch: bit for bit gguf's dequantizer
    (tests/runtime/test_gguf_linear.py), and 3x faster (SmolLM2 Q4_K_M's 211 quantized tensors: 0.54 s against
    1.60 s; F16, a cast, is as fast read directly)."""
    form = stored_form(source, name) if isinstance(source, GGUFSource) else None
    block = has_module(form) and form is not GGMLQuantType.F16
    rows = quantized_module(form, _stored_weight(source, name), None, rows=True) if block else None
    if rows is None:
        return source.load(name, dtype=torch.float32).to(device=device, dtype=dtype)
    return rows.rows(slice(None)).to(device=device, dtype=dtype)


def _place(model: Decoder, source: ModelSource, name: str, form: Hashable, dtype: torch.dtype, device: torch.device,
           tied: bool) -> None:
    """Put weight `name` into `model` as the registry's module for it, or as floats where none fits. A stored
    embedding becomes a QuantizedEmbedding over the tied head's module where that gives rows (held once),
    else over a table module of its own."""
    weight = _stored_weight(source, name)
    path = hf_to_param_name(name).removesuffix(".weight")
    if path == "embed_tokens":
        if tied:
            model.lm_head = quantized_module(form, weight, None, dtype, device)
        table = model.lm_head if tied and isinstance(model.lm_head, RowSource) else quantized_module(
            form, weight, None, dtype, device, rows=True)
        model.embed_tokens = QuantizedEmbedding(table, dtype)
        return
    module = quantized_module(form, weight, model.get_submodule(path).bias, dtype, device)
    if module is None:
        model.load_state_dict({hf_to_param_name(name): _float(source, name, dtype, device)}, strict=False,
                              assign=True)
    else:
        _replace(model, path, module)


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
