"""The one check between reading a model and using it: an architecture's numbers have the types and
ranges a decoder needs and agree with the tensors the files hold. Run by every reader (HF folder,
GGUF, GPTQ/AWQ) before anything is allocated from those numbers; errors name the file, the key or
tensor, and what was expected. GGUF container facts (alignment, offsets, blocks) are checked where
the header is parsed (`gguf_header.py`)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from llmopt.errors import InputError

MAX_DIM = 1 << 31  # no real model has a dimension this long; larger values are corrupt or hostile
MAX_LAYERS = 4096
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def integer(value: Any, where: str, lo: int = 1, hi: int = MAX_DIM) -> int:
    """`value` as an int in [lo, hi], or an InputError naming `where` (bools and floats are not ints)."""
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer() and math.isfinite(value):
            value = int(value)
        else:
            raise InputError(f"{where}: expected an integer, got {_show(value)}")
    if not lo <= value <= hi:
        raise InputError(f"{where}: {value} is out of range (expected {lo} to {hi})")
    return value


def number(value: Any, where: str, lo: float = 0.0, hi: float = 1e30, open_lo: bool = False) -> float:
    """`value` as a finite float in [lo, hi] ((lo, hi] with `open_lo`), or an InputError naming `where`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(f"{where}: expected a number, got {_show(value)}")
    value = float(value)
    if not math.isfinite(value) or value < lo or value > hi or (open_lo and value == lo):
        raise InputError(f"{where}: {value} is out of range (expected {'more than' if open_lo else 'at least'} {lo:g})")
    return value


def check_heads(heads: int, kv_heads: int, where: str) -> None:
    if heads % kv_heads:
        raise InputError(f"{where}: {heads} attention heads do not divide into {kv_heads} key/value heads")


def check_tensors(arch: Any, shapes: Mapping[str, Sequence[int]], where: str) -> None:
    """The architecture agrees with the tensors (HF names): as many layers as the config says, and
    every tensor the family expects present (as `.weight`, or `.qweight` in GPTQ/AWQ checkpoints,
    `.weight_packed` in compressed-tensors ones)
    with the shape the config implies. Catches a layer count, width or vocabulary that lies."""
    layers = {int(m.group(1)) for name in shapes if (m := _LAYER.match(name))}
    if layers != set(range(arch.num_layers)):
        found = "none" if not layers else f"{len(layers)} (0 to {max(layers)})"
        raise InputError(f"{where}: the config says {arch.num_layers} layers, the tensors hold layers {found}")
    expected = [("model.embed_tokens.weight", (arch.vocab_size, arch.hidden_size)), ("model.norm.weight", (arch.hidden_size,))]
    if not arch.tie_word_embeddings:
        expected.append(("lm_head.weight", (arch.vocab_size, arch.hidden_size)))
    for i in range(arch.num_layers):
        expected += [(f"model.layers.{i}.{suffix}" if not suffix.startswith("model.") else suffix, shape)
                     for suffix, shape in _block_shapes(arch, i)]  # fmt: skip
    for name, shape in expected:
        if "*" in name and name not in shapes:  # an expert stack (as GGUF holds it), held one tensor per expert
            for e in range(shape[0]):
                _check_one(shapes, name.replace(".*.", f".{e}."), shape[1:], where)
        else:
            _check_one(shapes, name, shape, where)


def _check_one(shapes: Mapping[str, Sequence[int]], name: str, shape: Sequence[int], where: str) -> None:
    if name in shapes:
        if tuple(shapes[name]) != tuple(shape):
            raise InputError(f"{where}: {name} is {list(shapes[name])}; the config implies {list(shape)}")
    elif not any(name.removesuffix(".weight") + packed in shapes for packed in (".qweight", ".weight_packed")):
        raise InputError(f"{where}: tensor {name} is missing")


def _block_shapes(arch: Any, layer: int) -> list[tuple[str, tuple[int, ...]]]:
    prefix = f"model.layers.{layer}."
    return [(hf.removeprefix(prefix), shape) for hf, _, shape, _ in arch.family.tensor_shapes(arch, layer)]


def _show(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"
