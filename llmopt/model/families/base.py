"""What a decoder family is: its names, its block, and its stage table, as data.

Every place that depends on the architecture reads the family instead of restating it: the
decoder builds `family.block`, the quantization pipeline and the imatrix collector walk
`family.stages`, the GGUF reader and writer map names with `hf_to_gguf_name`, and the planner
lists `block_tensors`. A new family is one module in this folder that builds a `Family`.

The stage table lists the linears of a block in the order the forward reaches them, grouped by
the input they share, with the module that produces that input (a norm, or the linear before).
GPTQ quantizes stage by stage (true-sequential); AWQ folds its scales into each stage's producer.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from llmopt.errors import InputError


if TYPE_CHECKING:
    import torch
    from torch import nn

    from llmopt.model.arch import ArchSpec

# Roles of a tensor, which decide how it is stored: linears are what GPTQ/AWQ quantize; experts are
# linears of which only some are read per token; the rest stay in float in every format.
LINEAR, EXPERT, EMBEDDING, OUTPUT, NORM, BIAS, ROUTER, ROPE = (
    "linear", "expert", "embedding", "output", "norm", "bias", "router", "rope")  # fmt: skip


@dataclass(frozen=True)
class Fused:
    """One linear in the files that holds several of the block's linears, stacked by rows.

    Phi-3 stores q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj`. Readers split it into
    the block's linears (so the decoder, the stage table and every method see Llama's block), and
    writers stack the parts again (HF, GGUF and GPTQ/AWQ files keep the fused layout)."""

    name: str  # block-relative module name in HF files, e.g. "self_attn.qkv_proj"
    gguf: str  # llama.cpp's name for it after "blk.{i}.", e.g. "attn_qkv"
    parts: tuple[str, ...]  # the block linears it holds, in row order, e.g. ("self_attn.q_proj", ...)


@dataclass(frozen=True)
class Stage:
    """Linears of a block that read the same input, and the module that produces that input."""

    linears: tuple[str, ...]  # block-relative module names, in forward order, e.g. "self_attn.q_proj"
    producer: str  # block-relative name of the norm or linear whose output they read
    scope: str  # the smallest module containing the linears whose output measures their error


# The Llama block's stages (Llama, Mistral, Qwen2, Qwen3 share it).
LLAMA_STAGES = (
    Stage(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "input_layernorm", "self_attn"),
    Stage(("self_attn.o_proj",), "self_attn.v_proj", "self_attn.o_proj"),
    Stage(("mlp.gate_proj", "mlp.up_proj"), "post_attention_layernorm", "mlp"),
    Stage(("mlp.down_proj",), "mlp.up_proj", "mlp.down_proj"),
)

# Per-block tensors of the Llama block: HF suffix after "model.layers.{i}." -> GGUF suffix after "blk.{i}.".
LLAMA_BLOCK_TENSORS: dict[str, str] = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
QK_NORM_TENSORS: dict[str, str] = {"self_attn.q_norm.weight": "attn_q_norm.weight",
                                   "self_attn.k_norm.weight": "attn_k_norm.weight"}
# Mixtral's router and experts, as llama.cpp's converter stacks them (planned, not read or run yet).
MOE_TENSORS: dict[str, str] = {"block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
                               "block_sparse_moe.experts.*.w1.weight": "ffn_gate_exps.weight",
                               "block_sparse_moe.experts.*.w3.weight": "ffn_up_exps.weight",
                               "block_sparse_moe.experts.*.w2.weight": "ffn_down_exps.weight"}
GLOBAL_TENSORS: dict[str, str] = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
HEAD = "lm_head"  # the LM head's module name (its weight is the embedding when tied)

_HF_BLOCK = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_GGUF_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")
_GGUF_TO_HF_GLOBAL = {v: k for k, v in GLOBAL_TENSORS.items()}


def _no_keys(arch: ArchSpec) -> dict[str, Any]:
    return {}


def _default_block(arch: ArchSpec, layer: int) -> nn.Module:
    from llmopt.model.decoder import DecoderBlock

    return DecoderBlock(arch, layer)


def _unchanged(arch: ArchSpec, read: dict[str, Any]) -> ArchSpec:
    return arch


def _one_rope(arch: ArchSpec) -> tuple[ArchSpec, ...]:
    return (arch,)


def _whole_context(arch: ArchSpec) -> list[int | None]:
    return [None] * arch.num_layers


@dataclass(frozen=True)
class Family:
    name: str
    hf_architectures: tuple[str, ...]
    hf_model_type: str
    gguf_arch: str
    permute_qk: bool  # llama.cpp's "llama" arch stores Q/K rows interleaved per head (rope layout)
    qkv_bias: bool = False  # attention_bias when the config does not say
    qk_norm: bool = False  # per-head RMSNorm of q and k before rope (Qwen3)
    reads_gguf: bool = True  # False when another family owns the GGUF arch name (mistral -> llama)
    stages: tuple[Stage, ...] = LLAMA_STAGES
    score_linears: tuple[str, ...] = ("self_attn.q_proj", "self_attn.k_proj")  # their outputs meet in q·k
    # family-specific keys of the config.json llmopt writes (beyond the shared ones in ArchSpec)
    hf_config_keys: Callable[[ArchSpec], dict[str, Any]] = field(default=_no_keys, compare=False)
    make_block: Callable[[ArchSpec, int], nn.Module] = field(default=_default_block, compare=False)
    fused: tuple[Fused, ...] = ()  # linears that files store stacked (Phi-3's qkv_proj, gate_up_proj)
    # Gemma's conventions (llama.cpp's converter calls the first `norm_shift`): a norm scales by
    # (norm_shift + weight), and GGUF files store norm_shift + weight; the embedding's output is
    # scaled by sqrt(hidden_size); the gated MLP's activation (a transformers `hidden_act` name)
    norm_shift: float = 0.0
    scale_embedding: bool = False
    activation: str = "silu"
    # hidden-wide norms of the block beyond (or renaming) Llama's two: (HF suffix, GGUF suffix)
    extra_norms: tuple[tuple[str, str], ...] = ()
    # what ArchSpec's generic readers leave out: the family's own config.json / GGUF keys, read into
    # the spec (fields or `extra`) after the shared ones; and the GGUF keys its writer adds
    adapt_hf: Callable[[ArchSpec, dict[str, Any]], ArchSpec] = field(default=_unchanged, compare=False)
    adapt_gguf: Callable[[ArchSpec, dict[str, Any]], ArchSpec] = field(default=_unchanged, compare=False)
    gguf_keys: Callable[[ArchSpec], dict[str, Any]] = field(default=_no_keys, compare=False)
    # the rope tables the blocks read, one spec per table (Gemma 3: global and sliding layers' bases);
    # the decoder hands every block all of them side by side, head_dim wide each
    rope_archs: Callable[[ArchSpec], tuple[ArchSpec, ...]] = field(default=_one_rope, compare=False)
    # per layer, how many past tokens its KV cache must keep (None: the whole context). llama.cpp
    # keeps Mistral's whole cache ("llama" has no window), so only Gemma 3 names its sliding layers'
    kv_windows: Callable[[ArchSpec], list[int | None]] = field(default=_whole_context, compare=False)

    # ------------------------------------------------------------------------------ names
    @property
    def block_tensors(self) -> dict[str, str]:
        """HF suffix -> GGUF suffix of every tensor a block of this family can hold in its files
        (a fused linear under its stored name; its parts are not stored)."""
        tensors = {**LLAMA_BLOCK_TENSORS, **(QK_NORM_TENSORS if self.qk_norm else {}), **dict(self.extra_norms)}
        for f in self.fused:
            for part in f.parts:
                tensors.pop(f"{part}.weight")
                tensors.pop(f"{part}.bias", None)
            tensors[f"{f.name}.weight"] = f"{f.gguf}.weight"
        return tensors

    def fused_of(self, hf_name: str) -> tuple[str, Fused] | None:
        """(the stored tensor's HF name, its `Fused`) of a part's tensor ("...q_proj.weight"), else None."""
        m = _HF_BLOCK.match(hf_name)
        if m:
            module, _, leaf = m.group(2).rpartition(".")
            for f in self.fused:
                if module in f.parts:
                    return f"model.layers.{m.group(1)}.{f.name}.{leaf}", f
        return None

    def part_names(self, hf_name: str) -> list[str] | None:
        """The parts' HF names of a stored fused tensor ("...qkv_proj.weight"), in row order, else None."""
        m = _HF_BLOCK.match(hf_name)
        if m:
            module, _, leaf = m.group(2).rpartition(".")
            for f in self.fused:
                if module == f.name:
                    return [f"model.layers.{m.group(1)}.{part}.{leaf}" for part in f.parts]
        return None

    def split(self, arch: ArchSpec, hf_name: str) -> list[tuple[str, int, int]] | None:
        """The parts of a stored fused tensor as (part's HF name, first row, end row), else None."""
        names = self.part_names(hf_name)
        if names is None:
            return None
        rows, out, start = linear_rows(arch), [], 0
        for name in names:
            n = rows[name.split(".", 3)[3].rpartition(".")[0]]
            out.append((name, start, start + n))
            start += n
        return out

    def stored_names(self, hf_names: Iterable[str]) -> dict[str, list[str]]:
        """Stored tensor name -> the logical tensors it holds (itself, or a fused linear's parts in row
        order), for the logical names a source lists: the tensors a writer of this family's files writes."""
        names = list(hf_names)
        present = set(names)
        groups: dict[str, list[str]] = {}
        for name in names:
            fused = self.fused_of(name)
            if fused is None:
                groups[name] = [name]
            elif fused[0] not in groups:
                parts = self.part_names(fused[0]) or []
                missing = [p for p in parts if p not in present]
                if missing:
                    raise InputError(f"{fused[0]} is stored fused; its part {missing[0]} is missing")
                groups[fused[0]] = parts
        return groups

    @property
    def linears(self) -> tuple[str, ...]:
        """The block's linears in forward order (what a method quantizes)."""
        return tuple(name for stage in self.stages for name in stage.linears)

    def hf_to_gguf_name(self, hf_name: str) -> str | None:
        """llama.cpp's name for an HF tensor (a fused linear's part: the fused tensor's), or None for
        tensors GGUF does not store."""
        if hf_name in GLOBAL_TENSORS:
            return GLOBAL_TENSORS[hf_name]
        fused = self.fused_of(hf_name)
        if fused is not None:
            hf_name = fused[0]
        m = _HF_BLOCK.match(hf_name)
        if m and m.group(2) in self.block_tensors:
            return f"blk.{m.group(1)}.{self.block_tensors[m.group(2)]}"
        return None

    def gguf_to_hf_name(self, gguf_name: str) -> str | None:
        """The HF name of a GGUF tensor (a fused linear's stored name), or None for GGUF-only tensors
        such as rope_freqs."""
        if gguf_name in _GGUF_TO_HF_GLOBAL:
            return _GGUF_TO_HF_GLOBAL[gguf_name]
        m = _GGUF_BLOCK.match(gguf_name)
        if m:
            for hf, gguf in self.block_tensors.items():
                if gguf == m.group(2):
                    return f"model.layers.{m.group(1)}.{hf}"
        return None

    def gguf_shift(self, hf_name: str) -> float:
        """What GGUF files add to this tensor's values: `norm_shift` for norms (llama.cpp's converter
        shifts every tensor whose name ends in "norm.weight"), else 0."""
        return self.norm_shift if hf_name.endswith("norm.weight") else 0.0

    def qk_heads(self, hf_name: str, num_heads: int, num_kv_heads: int) -> int | None:
        """Heads to permute over if this tensor is stored permuted in GGUF, else None."""
        if not self.permute_qk:
            return None
        if ".self_attn.q_proj." in hf_name:
            return num_heads
        if ".self_attn.k_proj." in hf_name:
            return num_kv_heads
        return None

    # ------------------------------------------------------------------------------ shapes
    def tensor_shapes(self, arch: ArchSpec, layer: int) -> list[tuple[str, str, tuple[int, ...], str]]:
        """(HF name, GGUF name, HF-orientation shape, role) of every tensor of block `layer` as files
        store it (a fused linear as one tensor), in checkpoint order."""
        h, hd = arch.hidden_size, arch.head_dim
        q, kv = arch.num_heads * hd, arch.num_kv_heads * hd
        block: list[tuple[str, tuple[int, ...], str]] = [
            ("input_layernorm.weight", (h,), NORM),
            ("self_attn.q_proj.weight", (q, h), LINEAR),
            ("self_attn.k_proj.weight", (kv, h), LINEAR),
            ("self_attn.v_proj.weight", (kv, h), LINEAR),
        ]
        if arch.attention_bias:
            block += [("self_attn.q_proj.bias", (q,), BIAS), ("self_attn.k_proj.bias", (kv,), BIAS),
                      ("self_attn.v_proj.bias", (kv,), BIAS)]  # fmt: skip
        if self.qk_norm:
            block += [("self_attn.q_norm.weight", (hd,), NORM), ("self_attn.k_norm.weight", (hd,), NORM)]
        block += [("self_attn.o_proj.weight", (h, q), LINEAR), ("post_attention_layernorm.weight", (h,), NORM)]
        block += [(name, (h,), NORM) for name, _ in self.extra_norms if name != "post_attention_layernorm.weight"]
        f, experts = arch.intermediate_size, int(arch.extra.get("num_experts", 0))
        if not experts:
            block += [("mlp.gate_proj.weight", (f, h), LINEAR), ("mlp.up_proj.weight", (f, h), LINEAR),
                      ("mlp.down_proj.weight", (h, f), LINEAR)]  # fmt: skip
        else:  # Mixtral (planning only): a router and experts w1/w3/w2 (gate/up/down), stacked in GGUF
            block += [("block_sparse_moe.gate.weight", (experts, h), ROUTER),
                      ("block_sparse_moe.experts.*.w1.weight", (experts, f, h), EXPERT),
                      ("block_sparse_moe.experts.*.w3.weight", (experts, f, h), EXPERT),
                      ("block_sparse_moe.experts.*.w2.weight", (experts, h, f), EXPERT)]  # fmt: skip
        for f in self.fused:  # one stored linear in place of its parts, rows stacked
            first = next(i for i, b in enumerate(block) if b[0] == f"{f.parts[0]}.weight")
            parts = [b for b in block if b[0].removesuffix(".weight") in f.parts]
            block = [b for b in block if b not in parts]
            block.insert(first, (f"{f.name}.weight", (sum(b[1][0] for b in parts), h), LINEAR))
        names = {**self.block_tensors, **MOE_TENSORS}
        return [(f"model.layers.{layer}.{suffix}", f"blk.{layer}.{names[suffix]}", shape, role)
                for suffix, shape, role in block]


def linear_rows(arch: ArchSpec) -> dict[str, int]:
    """Output rows of each linear of the Llama block (what a fused linear's parts take)."""
    q, kv, f = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, arch.intermediate_size
    return {"self_attn.q_proj": q, "self_attn.k_proj": kv, "self_attn.v_proj": kv, "self_attn.o_proj": arch.hidden_size,
            "mlp.gate_proj": f, "mlp.up_proj": f, "mlp.down_proj": arch.hidden_size}


def permute_for_gguf(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF rows (halves of each head: [re..., im...]) -> llama.cpp rows (pairs: re, im, re, im)."""
    rows = t.shape[0]
    return t.reshape(n_heads, 2, rows // n_heads // 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def unpermute_from_gguf(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of `permute_for_gguf`."""
    rows = t.shape[0]
    return t.reshape(n_heads, rows // n_heads // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)
