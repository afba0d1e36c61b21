"""llama.cpp's quantization mixes: which GGML type each tensor gets under "Q4_K_M" and friends.

A mix (llama.cpp's "ftype") is a default type plus per-tensor upgrades. These rules restate
`llama_tensor_get_type` of llama.cpp's src/llama-quant.cpp for dense decoders (Llama, Mistral,
Qwen2): the output/tied-embedding rule, the attn_v and ffn_down upgrades (`use_more_bits`), the
attn_output upgrades, the fallbacks when a row does not divide into the type's block, `--tensor-type`
regex overrides, and the tensors that are never quantized (1-D, norms). The `recommend` planner and
`convert --to gguf` both call `tensor_type`, so a plan and a file always agree.

llama.cpp counts attn_v and ffn_down tensors with running counters in its (layer, name) tensor
order; for a dense model the counter equals the layer index. A tensor matched by a `--tensor-type`
override skips the rules and so does not advance the counter: `plan_shapes` reproduces that.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass

from llmopt.errors import InputError, OptionError
from llmopt.formats.gguf.types import block_geometry, is_quantized, writable_type
from llmopt.model.arch import ArchSpec
from llmopt.model.families.base import num_experts

MIXES: tuple[str, ...] = (
    "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
    "Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K",
    "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0", "MXFP4_MOE", "Q2_K_S",
    "IQ3_M", "IQ3_S", "IQ3_XS", "IQ3_XXS", "IQ2_M", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_M", "IQ1_S",
)  # fmt: skip

# The mixes of the legacy and K types: `automix` labels its files with the nearest of these.
CLASSIC_MIXES: tuple[str, ...] = MIXES[: MIXES.index("Q6_K") + 1]

# llama_ftype_get_default_type: the type every quantizable tensor starts from.
DEFAULT_TYPE: dict[str, str] = {
    "F16": "F16", "BF16": "BF16", "Q8_0": "Q8_0", "Q4_0": "Q4_0", "Q4_1": "Q4_1", "Q5_0": "Q5_0",
    "Q5_1": "Q5_1", "Q2_K": "Q2_K", "Q3_K_S": "Q3_K", "Q3_K_M": "Q3_K", "Q3_K_L": "Q3_K",
    "Q4_K_S": "Q4_K", "Q4_K_M": "Q4_K", "Q5_K_S": "Q5_K", "Q5_K_M": "Q5_K", "Q6_K": "Q6_K",
    "IQ4_NL": "IQ4_NL", "IQ4_XS": "IQ4_XS", "TQ1_0": "TQ1_0", "TQ2_0": "TQ2_0", "MXFP4_MOE": "MXFP4",
    "IQ3_M": "IQ3_S", "IQ3_S": "IQ3_S", "IQ3_XS": "IQ3_S", "IQ3_XXS": "IQ3_XXS", "IQ2_M": "IQ2_S", "IQ2_S": "IQ2_XS",
    "IQ2_XS": "IQ2_XS", "IQ2_XXS": "IQ2_XXS", "IQ1_M": "IQ1_M", "IQ1_S": "IQ1_S", "Q2_K_S": "Q2_K",
}  # fmt: skip

# tensor_type_fallback: what a type becomes when the row length does not divide into its block.
# (A 32-element block type has none: it becomes F16.)
FALLBACK: dict[str, str] = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0",
                            "IQ4_XS": "IQ4_NL", "TQ1_0": "Q4_0", "TQ2_0": "Q4_0", "IQ3_S": "IQ4_NL",
                            "IQ3_XXS": "IQ4_NL", "IQ2_S": "IQ4_NL", "IQ2_XS": "IQ4_NL", "IQ2_XXS": "IQ4_NL",
                            "IQ1_S": "IQ4_NL", "IQ1_M": "IQ4_NL"}  # fmt: skip
IQ4_MIXES = ("IQ4_NL", "IQ4_XS")
# the 2-bit (and 1-bit) i-quant mixes, which llama.cpp gives their own rules and a Q5_K output
LOW_BIT_MIXES = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ1_S", "IQ1_M")
# tensor_requires_imatrix: llama-quantize refuses these types without an importance matrix (except in
# token_embd/output), even where ggml's quantizer could do without
IMATRIX_TYPES = ("IQ3_XXS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M")
TERNARY_MIXES = ("TQ1_0", "TQ2_0")

_LAYER = re.compile(r"^blk\.(\d+)\.")
FFN_KINDS = ("ffn_down", "ffn_gate", "ffn_up")
COUNTED_KINDS = ("attn_v",) + FFN_KINDS  # the tensors llama.cpp's rules count in loader order


def check_mix(mix: str) -> str:
    """The canonical mix name, or an InputError listing the supported ones."""
    name = mix.upper()
    if name not in MIXES:
        raise InputError(f"unknown GGUF type {mix!r}; choose one of: {', '.join(MIXES)}")
    return name


def file_type(mix: str) -> int:
    """`general.file_type` (llama_ftype) of a mix (gguf's table, imported only when a file is written)."""
    from gguf.constants import LlamaFileType

    return int(LlamaFileType[f"MOSTLY_{check_mix(mix)}"])


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of layers that get more bits: the first and last eighth, and every third."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or _c_mod(i_layer - n_layers // 8, 3) == 2


def layer_signature(i_layer: int, n_layers: int) -> tuple[bool, ...]:
    """Every test of the layer index that `_mix_rules` makes (keep the two in step): layers with the
    same signature get the same type under every mix, which is what lets `ShapeClasses` size an
    80-layer model's counted tensors as a handful of classes."""
    eighth = n_layers // 8
    return (i_layer < 2, i_layer < 4, i_layer < n_layers // 16, i_layer < eighth, i_layer >= 7 * n_layers // 8,
            _c_mod(i_layer - eighth, 3) == 2)  # fmt: skip


def _c_mod(a: int, b: int) -> int:
    """C's % (truncates toward zero), which differs from Python's for negative a."""
    return a - b * int(a / b)


def allows_quantization(gguf_name: str, shape: Sequence[int]) -> bool:
    """tensor_allows_quantization for our families: `*weight` tensors of two or more dimensions as
    ggml_n_dims counts them (a [1, hidden] matrix, Qwen2-MoE's shared-expert gate, is one), not norms
    or an MoE router (`ffn_gate_inp`, which llama.cpp keeps in float)."""
    n_dims = len(shape) - next((i for i, n in enumerate(shape) if n != 1), len(shape) - 1)  # HF order: outer first
    return (n_dims >= 2 and gguf_name.endswith("weight") and "_norm.weight" not in gguf_name
            and "ffn_gate_inp.weight" not in gguf_name)


def category(gguf_name: str) -> str:
    """tensor_get_category: the role of a tensor, by llama.cpp's substring tests, in its order."""
    if gguf_name == "output.weight":
        return "output"
    if gguf_name == "token_embd.weight":
        return "token_embd"
    for cat, key in (
        ("attn_qkv", "attn_qkv.weight"), ("attn_kv_b", "attn_kv_b.weight"), ("attn_v", "attn_v.weight"),
        ("attn_k", "attn_k.weight"), ("attn_q", "attn_q.weight"), ("attn_output", "attn_output.weight"),
        ("ffn_up", "ffn_up"), ("ffn_gate", "ffn_gate"), ("ffn_down", "ffn_down"),
    ):  # fmt: skip
        if key in gguf_name:
            return cat
    return "other"


def _is_70b(arch: ArchSpec) -> bool:
    """llama.cpp's LLM_TYPE_70B, which bumps attn_v: 80 layers (with GQA for the llama arch; an
    8-expert llama is never 70B: models/llama.cpp sizes it as 8x7B or 8x22B)."""
    if arch.num_layers != 80 or num_experts(arch) == 8:
        return False
    return arch.family.gguf_arch != "llama" or arch.num_heads != arch.num_kv_heads


def requires_imatrix(gguf_name: str, type_name: str, mix: str) -> bool:
    """llama-quantize's tensor_requires_imatrix: a very-low-bit i-quant tensor, or a Q2_K one in a
    Q2_K_S file, that is not the token embedding or the output."""
    needs = type_name in IMATRIX_TYPES or (type_name == "Q2_K" and mix == "Q2_K_S")
    return needs and gguf_name not in ("token_embd.weight", "output.weight")


def _mix_rules(cat: str, new_type: str, mix: str, arch: ArchSpec, row_length: int, i_layer: int, n_layer: int,
               tied: bool, has_imatrix: bool, output_tensor_type: str | None, stacked: bool = False,
               name_layer: int = 0) -> str:  # fmt: skip
    """llama_tensor_get_type_impl restricted to the mixes in MIXES and the families llmopt
    reads: dense decoders and experts (`stacked`: a 3-D expert stack; llama.cpp's n_expert rules).
    `i_layer` is the tensor's running count among its kind, `name_layer` the layer its name says: with
    experts, llama.cpp's ffn rules take the latter (layer_info), as a shared expert's ffn_down_shexp
    advances the count too. Each test of either here must be one of `layer_signature`'s."""
    if cat == "output" or (tied and cat == "token_embd"):
        if output_tensor_type is not None:
            return output_tensor_type
        if mix == "MXFP4_MOE" or arch.family.gguf_arch == "falcon" or row_length % block_geometry(new_type)[0] != 0:
            return "Q8_0"
        if mix in LOW_BIT_MIXES or mix == "IQ3_XXS":
            return "Q5_K"
        return new_type if new_type == "Q8_0" else "Q6_K"
    if mix == "MXFP4_MOE":  # MXFP4 for the 3-D expert stacks, Q8_0 for the rest
        return "MXFP4" if stacked else "Q8_0"
    if cat == "token_embd":
        if mix in ("IQ2_XXS", "IQ2_XS", "IQ1_S", "IQ1_M"):
            return "Q2_K"
        if mix in ("IQ2_S", "IQ2_M", "IQ3_XXS"):
            return "IQ3_S"
        return "Q4_K" if mix in TERNARY_MIXES else new_type
    n_gqa, n_expert = arch.num_heads // max(1, arch.num_kv_heads), num_experts(arch)
    if mix in LOW_BIT_MIXES:  # (these count ffn_down without layer_info)
        return _low_bit_rules(cat, new_type, mix, i_layer, n_layer, n_gqa, n_expert)
    if n_expert > 1 and cat in FFN_KINDS:
        i_layer = name_layer
    if cat == "attn_k" and n_expert == 8:  # llama.cpp: "for the 8-expert model, bumping this to Q8_0 trades just ~128MB"
        return "Q8_0"
    if cat in ("attn_q", "attn_k"):
        return {"IQ3_XS": "IQ3_XXS", "IQ3_XXS": "IQ2_S"}.get(mix, new_type)
    if cat in ("ffn_gate", "ffn_up"):  # (llama.cpp counts these per kind; for a dense model the count is the layer)
        return "IQ3_XXS" if mix == "IQ3_XS" and n_layer // 8 <= i_layer < 7 * n_layer // 8 else new_type
    if cat in ("attn_v", "attn_qkv", "attn_kv_b"):
        if mix == "Q2_K":
            new_type = "Q4_K" if n_gqa >= 4 else "Q3_K"
        elif mix == "Q2_K_S" and n_gqa >= 4:
            new_type = "Q4_K"
        elif mix == "Q3_K_M":
            new_type = "Q5_K" if i_layer < 2 else "Q4_K"
        elif mix == "Q3_K_L":
            new_type = "Q5_K"
        elif mix in IQ4_MIXES and n_gqa >= 4:
            new_type = "Q5_K"
        elif mix in ("Q4_K_M", "Q5_K_M") and use_more_bits(i_layer, n_layer):
            new_type = "Q6_K"
        elif mix == "Q4_K_S" and i_layer < 4:
            new_type = "Q5_K"
        elif mix == "IQ3_XXS":
            new_type = "Q4_K" if n_gqa >= 4 else "IQ3_XXS" if has_imatrix else "IQ3_S"
        elif (mix in ("IQ3_XS", "IQ3_S") and n_gqa >= 4) or mix == "IQ3_M":
            new_type = "Q4_K"
        if _is_70b(arch) and new_type in ("Q3_K", "Q4_K"):
            new_type = "Q5_K"
        return "Q8_0" if n_expert == 8 else new_type
    if cat == "ffn_down":
        if mix == "Q2_K":
            return "Q3_K"
        if mix == "Q2_K_S":
            return "Q4_K" if i_layer < n_layer // 8 else new_type
        if mix == "Q3_K_M":
            return "Q5_K" if i_layer < n_layer // 16 else "Q4_K"
        if mix == "Q3_K_L":
            return "Q5_K"
        if mix == "Q4_K_M":
            return "Q6_K" if use_more_bits(i_layer, n_layer) else new_type
        if mix in IQ4_MIXES and i_layer < n_layer // 8 and not has_imatrix:
            return "Q5_K"
        if mix == "Q5_K_M" and use_more_bits(i_layer, n_layer):
            return "Q6_K"
        if mix == "Q4_K_S" and i_layer < n_layer // 8:
            return "Q5_K"
        if mix in ("Q4_0", "Q5_0") and has_imatrix and i_layer < n_layer // 8:
            return "Q4_1" if mix == "Q4_0" else "Q5_1"
        if mix == "IQ3_XXS" and not has_imatrix:
            return "Q4_K" if i_layer < n_layer // 8 else "Q3_K"
        if mix == "IQ3_M" and (i_layer < n_layer // 8 or (n_expert == 8 and use_more_bits(i_layer, n_layer))):
            return "Q4_K"
        return new_type
    if cat == "attn_output" and n_expert == 8:
        return "Q5_K" if mix in EIGHT_EXPERT_ATTN_OUTPUT_Q5_K else new_type
    if cat == "attn_output":
        return {"Q2_K": "Q3_K", "Q3_K_M": "Q4_K", "Q3_K_L": "Q5_K", "IQ3_XXS": "IQ3_S", "IQ3_M": "Q4_K"}.get(mix, new_type)
    return new_type


# the mixes whose attn_output llama.cpp raises to Q5_K in an 8-expert model (Mixtral)
EIGHT_EXPERT_ATTN_OUTPUT_Q5_K = ("Q2_K", "IQ3_XS", "IQ3_XXS", "Q3_K_S", "Q3_K_M", "IQ4_NL", "Q4_K_S", "Q4_K_M",
                                 "IQ3_S", "IQ3_M", "IQ4_XS")  # fmt: skip


def _low_bit_rules(cat: str, new_type: str, mix: str, i_layer: int, n_layer: int, n_gqa: int, n_expert: int) -> str:
    """llama.cpp's rules for the 2- and 1-bit i-quant mixes (no 70B bump): attn_v, the first eighth of
    ffn_down and attn_output get more bits (attn_k and attn_output more still in an 8-expert model)."""
    more = "IQ3_S" if mix in ("IQ2_S", "IQ2_M") else "Q2_K"
    if cat in ("attn_v", "attn_qkv", "attn_kv_b"):
        return "Q4_K" if n_gqa >= 4 or n_expert >= 4 else more
    if cat == "attn_k" and n_expert == 8:
        return "Q4_K"
    if cat == "ffn_down":
        return more if i_layer < n_layer // 8 else new_type
    if cat == "attn_output" and n_expert == 8:
        return "Q5_K"
    if cat == "attn_output":
        return {"IQ1_S": "IQ2_XXS", "IQ1_M": "IQ2_XXS", "IQ2_S": "IQ3_S", "IQ2_M": "IQ3_S"}.get(mix, new_type)
    return new_type


def _fallback(type_name: str, row_length: int) -> str:
    """tensor_type_fallback: a type whose block divides the row, else F16."""
    if row_length % block_geometry(type_name)[0] == 0:
        return type_name
    if type_name not in FALLBACK:
        if block_geometry(type_name)[0] <= 32:
            return "F16"
        raise InputError(f"no fallback type for {type_name} with rows of {row_length}")
    fallback = FALLBACK[type_name]
    return fallback if row_length % block_geometry(fallback)[0] == 0 else "F16"


def _layer_of(gguf_name: str) -> int:
    m = _LAYER.match(gguf_name)
    return int(m.group(1)) if m else 0


def _compile_overrides(overrides: Sequence[tuple[str, str]]) -> list[tuple[re.Pattern[str], str]]:
    compiled = []
    for pattern, type_name in overrides:
        try:
            compiled.append((re.compile(pattern), writable_type(type_name, "tensor_types")))
        except re.error as e:
            raise OptionError(f"bad <tensor_types> regex {pattern!r}: {e}") from None
    return compiled


def tensor_type(
    gguf_name: str,
    shape: tuple[int, ...],
    mix: str,
    arch: ArchSpec,
    *,
    overrides: Sequence[tuple[str, str]] = (),
    has_imatrix: bool = False,
    output_tensor_type: str | None = None,
    tied_embeddings: bool | None = None,
    counter: int | None = None,
) -> str:
    """The GGML type llama-quantize gives tensor `gguf_name` (HF-orientation `shape`) under `mix`.

    `overrides` are `--tensor-type` (regex, type) pairs, first match wins; `counter` is the tensor's
    position among its kind (attn_v / ffn_down) when it differs from its layer index (see plan_shapes);
    `tied_embeddings` defaults to the architecture's.
    """
    mix = check_mix(mix)
    tied = arch.tie_word_embeddings if tied_embeddings is None else tied_embeddings
    ott = writable_type(output_tensor_type, "output_tensor_type") if output_tensor_type is not None else None
    return _choose(gguf_name, shape, category(gguf_name), allows_quantization(gguf_name, shape), mix, arch,
                   _compile_overrides(overrides), has_imatrix, ott, tied, counter)  # fmt: skip


def _choose(gguf_name: str, shape: tuple[int, ...], cat: str, allowed: bool, mix: str, arch: ArchSpec,
            compiled: list[tuple[re.Pattern[str], str]], has_imatrix: bool, output_tensor_type: str | None,
            tied: bool, counter: int | None) -> str:  # fmt: skip
    """`tensor_type` once the per-mix work (the mix's name, the compiled overrides) is done."""
    default = DEFAULT_TYPE[mix]
    if not allowed:
        return "F32"
    if output_tensor_type is not None and cat == "output":
        return output_tensor_type
    if not is_quantized(default):
        return default
    new_type = default
    for pattern, type_name in compiled:
        if pattern.search(gguf_name):
            new_type = type_name
            break
    else:
        i_layer = _layer_of(gguf_name) if counter is None else counter
        new_type = _mix_rules(cat, default, mix, arch, shape[-1], i_layer, arch.num_layers, tied, has_imatrix,
                              output_tensor_type, stacked=len(shape) == 3 and shape[0] > 1,
                              name_layer=_layer_of(gguf_name))  # fmt: skip
    return _fallback(new_type, shape[-1])


def llama_order(names: Sequence[str]) -> list[str]:
    """Tensor names in llama.cpp's loader order: non-block tensors first, then by layer, then by name."""
    def key(n: str) -> tuple[int, str]:
        m = _LAYER.match(n)
        return (int(m.group(1)) if m else -1, n)

    return sorted(names, key=key)


def plan_shapes(
    shapes: dict[str, tuple[int, ...]],
    mix: str,
    arch: ArchSpec,
    *,
    overrides: Sequence[tuple[str, str]] = (),
    has_imatrix: bool = False,
    output_tensor_type: str | None = None,
) -> dict[str, str]:
    """`tensor_type` for every (gguf name -> HF shape), with llama.cpp's running counters."""
    classes = shape_classes(tuple(shapes), tuple(tuple(s) for s in shapes.values()), arch.num_layers)
    if not overrides:
        types = class_types(classes, mix, arch, has_imatrix=has_imatrix, output_tensor_type=output_tensor_type)
        return {name: types[c] for name, c in zip(shapes, classes.class_of)}
    # An overridden tensor skips the rules and does not advance its counter: plan in loader order.
    mix = check_mix(mix)
    compiled = _compile_overrides(overrides)
    ott = writable_type(output_tensor_type, "output_tensor_type") if output_tensor_type is not None else None
    quantized_default = is_quantized(DEFAULT_TYPE[mix])
    counters = dict.fromkeys(COUNTED_KINDS, 0)
    plan: dict[str, str] = {}
    for name, shape, cat, allowed, kind in classes.rows:
        counter = counters.get(kind)
        plan[name] = _choose(name, shape, cat, allowed, mix, arch, compiled, has_imatrix, ott, classes.tied, counter)
        if counter is not None and allowed and quantized_default and not any(p.search(name) for p, _ in compiled):
            counters[kind] += 1
    return {name: plan[name] for name in shapes}


@dataclass(frozen=True)
class ShapeClasses:
    """What llama.cpp's rules see of a model's tensors, worked out once per model.

    Without overrides a tensor's type depends on its name only through its category and running
    counter, and on the counter only through `layer_signature`, so tensors that share (category,
    quantizable, shape, signature) share a type under every mix: a 405B preset's ~1,100 tensors
    fall into a few dozen classes, and `recommend` sizes each class once per candidate format
    instead of each tensor.
    """

    rows: tuple[tuple, ...]  # (name, shape, category, quantizable, counter kind) in loader order
    members: tuple[tuple, ...]  # per class: (its first member's name, shape, category, quantizable, counter)
    class_of: tuple[int, ...]  # each tensor's class, in the order the shapes were given
    tied: bool  # no output.weight: the token embedding is also the output


@functools.lru_cache(maxsize=64)
def shape_classes(names: tuple[str, ...], shapes: tuple[tuple[int, ...], ...], n_layers: int) -> ShapeClasses:
    """The `ShapeClasses` of the tensors `names` with HF-orientation `shapes` in a model of
    `n_layers` layers (remembered per model)."""
    by_name = dict(zip(names, shapes))
    rows, counters, index, members, class_by_name = [], dict.fromkeys(COUNTED_KINDS, 0), {}, [], {}
    kinds: dict[str, tuple[str, str]] = {}  # category and counter kind, by the name past "blk.N."
    for name in llama_order(names):
        suffix = name.split(".", 2)[-1] if name.startswith("blk.") else name
        if suffix not in kinds:
            cat = category(name)
            kinds[suffix] = cat, "attn_v" if cat in ("attn_v", "attn_qkv", "attn_kv_b") else cat
        cat, kind = kinds[suffix]
        shape, allowed = by_name[name], allows_quantization(name, by_name[name])
        rows.append((name, shape, cat, allowed, kind))
        counter = counters.get(kind)
        if counter is not None and allowed:  # the counter only matters (and only runs) for quantized defaults
            counters[kind] += 1
        key = (cat, allowed, shape, None if counter is None else layer_signature(counter, n_layers),
               layer_signature(_layer_of(name), n_layers) if kind in FFN_KINDS else None)
        if key not in index:
            index[key] = len(members)
            members.append((name, shape, cat, allowed, counter))
        class_by_name[name] = index[key]
    return ShapeClasses(tuple(rows), tuple(members), tuple(class_by_name[n] for n in names), "output.weight" not in by_name)


def class_types(classes: ShapeClasses, mix: str, arch: ArchSpec, *, has_imatrix: bool = False,
                output_tensor_type: str | None = None) -> list[str]:  # fmt: skip
    """The GGML type of each class under `mix` (no overrides)."""
    mix = check_mix(mix)
    ott = writable_type(output_tensor_type, "output_tensor_type") if output_tensor_type is not None else None
    return [_choose(name, shape, cat, allowed, mix, arch, [], has_imatrix, ott, classes.tied, counter)
            for name, shape, cat, allowed, counter in classes.members]


def gguf_shapes(source) -> dict[str, tuple[int, ...]]:  # noqa: ANN001 - ModelSource (import cycle-free)
    """GGUF name -> HF-orientation shape for every tensor a GGUF written from `source` holds."""
    family = source.arch.family
    shapes: dict[str, tuple[int, ...]] = {}
    # a fused linear: its parts' rows stacked; an expert stack: the experts' tensors along a new first axis
    for hf_name, parts in family.stored_names(source.tensors, stack_experts=True).items():
        gguf_name = family.hf_to_gguf_name(hf_name)
        if gguf_name is None:
            continue
        if gguf_name == "output.weight" and source.arch.tie_word_embeddings:
            continue
        shapes[gguf_name] = family.stored_shape(hf_name, [tuple(source.tensors[p].shape) for p in parts])
    return shapes
