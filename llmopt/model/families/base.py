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
class Experts:
    """A block whose MLP is a router over E experts, each a gated MLP, of which each token uses top k.

    HF files store each expert's linears separately ("block_sparse_moe.experts.3.w1.weight"), which is
    how every path above the readers sees them (one linear per expert: the decoder, the stage table,
    GPTQ per expert); GGUF files stack each kind over the experts into one [E, rows, cols] tensor
    ("ffn_gate_exps"), which the GGUF reader splits and the GGUF writer stacks again. Files name the
    stack with "*" in place of the expert number ("block_sparse_moe.experts.*.w1.weight")."""

    router: str  # block-relative router module, e.g. "block_sparse_moe.gate" (GGUF "ffn_gate_inp")
    module: str  # block-relative module holding the experts, e.g. "block_sparse_moe.experts"
    gate: str  # expert-relative names of the gated MLP's linears (Mixtral: w1, w3, w2)
    up: str
    down: str
    renormalize: bool = True  # the top-k routing weights are divided by their sum (Mixtral; a config may say)
    # an expert every token runs besides its routed ones (Qwen2-MoE's "mlp.shared_expert", a gated MLP with
    # the experts' linear names, GGUF ffn_*_shexp), its output scaled by sigmoid(shared_gate(x)), a linear
    # with one output (GGUF ffn_gate_inp_shexp)
    shared: str | None = None
    shared_gate: str | None = None
    norm: str = "post_attention_layernorm"  # the block-relative norm whose output the router and the experts read

    def linears(self) -> tuple[tuple[str, str], ...]:
        """(expert-relative linear, llama.cpp's name of its stack) in forward order."""
        return ((self.gate, "ffn_gate_exps"), (self.up, "ffn_up_exps"), (self.down, "ffn_down_exps"))

    def stages(self, count: int) -> tuple[Stage, ...]:
        """Each expert's two stages, experts in order (the order `SparseMoE` runs them): gate and up read
        the tokens routed to the expert (from the post-attention norm), down reads up's product; then the
        shared expert's two, which read every token."""
        out = []
        for expert in [f"{self.module}.{e}" for e in range(count)] + ([self.shared] if self.shared else []):
            out += [Stage((f"{expert}.{self.gate}", f"{expert}.{self.up}"), self.norm, expert),
                    Stage((f"{expert}.{self.down}",), f"{expert}.{self.up}", f"{expert}.{self.down}")]
        return tuple(out)

    def readers(self) -> dict[str, tuple[str, ...]]:
        """The norm -> the modules that read it besides the experts' linears and are never quantized (the
        router, the shared expert's gate): a method that rescales the norm's output (AWQ) rescales them."""
        return {self.norm: (self.router,) + ((self.shared_gate,) if self.shared_gate else ())}

    def stacks(self) -> dict[str, str]:
        """Block-relative HF suffix -> GGUF suffix of the router, each stacked kind and the shared expert's tensors."""
        out = {f"{self.router}.weight": "ffn_gate_inp.weight"}
        out.update({f"{self.module}.*.{name}.weight": f"{gguf}.weight" for name, gguf in self.linears()})
        if self.shared:
            out.update({f"{self.shared}.{name}.weight": f"{gguf.removesuffix('_exps')}_shexp.weight" for name, gguf in self.linears()})
            out[f"{self.shared_gate}.weight"] = "ffn_gate_inp_shexp.weight"
        return out


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
    from llmopt.model.decoder import DecoderBlock  # here, not at the top: the decoder imports torch

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
    # multimodal classes whose language model is this family (Gemma3ForConditionalGeneration): their
    # config.json nests it as `text_config` and their files prefix its tensors; llmopt reads the
    # language model alone (`model/multimodal.py`) and sets the vision tower aside
    hf_multimodal: tuple[str, ...] = ()
    # what transformers' config class assumes for keys a config.json leaves out (Gemma3TextConfig's:
    # a published multimodal config's `text_config` names only what differs from them)
    hf_defaults: dict[str, Any] = field(default_factory=dict, compare=False)
    # per layer, how many past tokens its KV cache must keep (None: the whole context). llama.cpp
    # keeps Mistral's whole cache ("llama" has no window), so only Gemma 3 names its sliding layers'
    kv_windows: Callable[[ArchSpec], list[int | None]] = field(default=_whole_context, compare=False)
    experts: Experts | None = None  # a mixture-of-experts MLP (Mixtral), its count in arch.extra["num_experts"]

    # ------------------------------------------------------------------------------ names
    @property
    def block_tensors(self) -> dict[str, str]:
        """HF suffix -> GGUF suffix of every tensor a block of this family can hold in its files
        (a fused linear under its stored name; its parts are not stored)."""
        tensors = {**LLAMA_BLOCK_TENSORS, **(QK_NORM_TENSORS if self.qk_norm else {}), **dict(self.extra_norms)}
        if self.experts is not None:  # the MLP's linears are the experts', stored stacked in GGUF
            for name in ("gate_proj", "up_proj", "down_proj"):
                tensors.pop(f"mlp.{name}.weight")
            tensors.update(self.experts.stacks())
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

    def expert_stack(self, hf_name: str) -> str | None:
        """The stack's HF name ("...experts.*.w1.weight") of one expert's tensor ("...experts.3.w1.weight"), else None."""
        m = _HF_BLOCK.match(hf_name)
        if self.experts is None or not m or not m.group(2).startswith(self.experts.module + "."):
            return None
        rest = m.group(2)[len(self.experts.module) + 1:].split(".", 1)
        if len(rest) != 2 or not rest[0].isdigit():
            return None
        return f"model.layers.{m.group(1)}.{self.experts.module}.*.{rest[1]}"

    def expert_of(self, hf_name: str) -> int | None:
        """The expert number of one expert's tensor ("...experts.3.w1.weight" -> 3), else None."""
        if self.expert_stack(hf_name) is None:
            return None
        return int(hf_name.split(f".{self.experts.module}.", 1)[1].split(".", 1)[0])  # type: ignore[union-attr]

    def is_stack(self, hf_name: str) -> bool:
        return self.experts is not None and f".{self.experts.module}.*." in hf_name

    def part_names(self, hf_name: str, arch: ArchSpec | None = None) -> list[str] | None:
        """The parts' HF names of a stored fused tensor ("...qkv_proj.weight"), in row order, or of an
        expert stack (given `arch`, which counts the experts), in expert order, else None."""
        if self.is_stack(hf_name):
            return None if arch is None else [hf_name.replace(".*.", f".{e}.") for e in range(num_experts(arch))]
        m = _HF_BLOCK.match(hf_name)
        if m:
            module, _, leaf = m.group(2).rpartition(".")
            for f in self.fused:
                if module == f.name:
                    return [f"model.layers.{m.group(1)}.{part}.{leaf}" for part in f.parts]
        return None

    def split(self, arch: ArchSpec, hf_name: str) -> list[tuple[str, int, int]] | None:
        """The parts of a stored fused tensor as (part's HF name, first row, end row), else None."""
        names = self.part_names(hf_name, arch)
        if names is None:
            return None
        rows, out, start = linear_rows(arch), [], 0
        for name in names:
            n = rows[(self.expert_stack(name) or name).split(".", 3)[3].rpartition(".")[0]]
            out.append((name, start, start + n))
            start += n
        return out

    def stored_names(self, hf_names: Iterable[str], stack_experts: bool = False) -> dict[str, list[str]]:
        """Stored tensor name -> the logical tensors it holds (itself, or a fused linear's parts in row
        order), for the logical names a source lists: the tensors a writer of this family's files writes.
        With `stack_experts` (GGUF), the experts' tensors of one kind are one stack, in expert order."""
        names = list(hf_names)
        present = set(names)
        groups: dict[str, list[str]] = {}
        for name in names:
            stack = self.expert_stack(name) if stack_experts else None
            if stack is not None:
                groups.setdefault(stack, []).append(name)
                continue
            fused = self.fused_of(name)
            if fused is None:
                groups[name] = [name]
            elif fused[0] not in groups:
                parts = self.part_names(fused[0]) or []
                missing = [p for p in parts if p not in present]
                if missing:
                    raise InputError(f"{fused[0]} is stored fused; its part {missing[0]} is missing")
                groups[fused[0]] = parts
        for stack, parts in groups.items():
            if self.is_stack(stack):  # in expert order (a file lists "experts.10" before "experts.2")
                expected = [stack.replace(".*.", f".{e}.") for e in range(len(parts))]
                if set(parts) != set(expected):
                    raise InputError(f"{stack}: the experts are not numbered 0 to {len(parts) - 1}")
                parts[:] = expected
        return groups

    def stored_shape(self, hf_name: str, part_shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
        """The shape of stored tensor `hf_name` from its parts': an expert stack adds an axis, a fused
        linear stacks rows."""
        if self.is_stack(hf_name):
            return (len(part_shapes), *part_shapes[0])
        return (sum(s[0] for s in part_shapes), *part_shapes[0][1:])

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
        hf_name = self.expert_stack(hf_name) or hf_name
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
        f, moe = arch.intermediate_size, self.experts
        if moe is None:
            block += [("mlp.gate_proj.weight", (f, h), LINEAR), ("mlp.up_proj.weight", (f, h), LINEAR),
                      ("mlp.down_proj.weight", (h, f), LINEAR)]  # fmt: skip
        else:  # a router and the experts' gate/up/down, each kind one [experts, rows, cols] stack in GGUF
            e, stack, f = num_experts(arch), f"{moe.module}.*.", expert_ffn(arch)
            block += [(f"{moe.router}.weight", (e, h), ROUTER), (f"{stack}{moe.gate}.weight", (e, f, h), EXPERT),
                      (f"{stack}{moe.up}.weight", (e, f, h), EXPERT), (f"{stack}{moe.down}.weight", (e, h, f), EXPERT)]  # fmt: skip
            if moe.shared:  # the shared expert (plain linears) and its one-output gate, kept in float as the router
                s = shared_expert_ffn(arch)
                block += [(f"{moe.shared}.{moe.gate}.weight", (s, h), LINEAR), (f"{moe.shared}.{moe.up}.weight", (s, h), LINEAR),
                          (f"{moe.shared}.{moe.down}.weight", (h, s), LINEAR), (f"{moe.shared_gate}.weight", (1, h), ROUTER)]  # fmt: skip
        for f in self.fused:  # one stored linear in place of its parts, rows stacked
            first = next(i for i, b in enumerate(block) if b[0] == f"{f.parts[0]}.weight")
            parts = [b for b in block if b[0].removesuffix(".weight") in f.parts]
            block = [b for b in block if b not in parts]
            block.insert(first, (f"{f.name}.weight", (sum(b[1][0] for b in parts), h), LINEAR))
        names = self.block_tensors
        return [(f"model.layers.{layer}.{suffix}", f"blk.{layer}.{names[suffix]}", shape, role)
                for suffix, shape, role in block]


def linear_rows(arch: ArchSpec) -> dict[str, int]:
    """Output rows of each linear of the block (what a fused linear's parts and a stack's experts take)."""
    q, kv, f = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, arch.intermediate_size
    rows = {"self_attn.q_proj": q, "self_attn.k_proj": kv, "self_attn.v_proj": kv, "self_attn.o_proj": arch.hidden_size,
            "mlp.gate_proj": f, "mlp.up_proj": f, "mlp.down_proj": arch.hidden_size}
    moe = arch.family.experts
    if moe is not None:
        e = expert_ffn(arch)
        rows.update({f"{moe.module}.*.{moe.gate}": e, f"{moe.module}.*.{moe.up}": e, f"{moe.module}.*.{moe.down}": arch.hidden_size})
    return rows


def num_experts(arch: ArchSpec) -> int:
    """How many experts each MoE block holds (0: a dense model)."""
    return int(arch.extra.get("num_experts", 0))


def experts_per_token(arch: ArchSpec) -> int:
    """How many experts each token is routed to (0: a dense model)."""
    return int(arch.extra.get("experts_per_token", 0))


def expert_ffn(arch: ArchSpec) -> int:
    """Each routed expert's intermediate width: Qwen2-MoE's `moe_intermediate_size`, else the config's
    `intermediate_size` (Mixtral)."""
    return int(arch.extra.get("expert_ffn", arch.intermediate_size))


def shared_expert_ffn(arch: ArchSpec) -> int:
    """The shared expert's intermediate width (Qwen2-MoE's `shared_expert_intermediate_size`)."""
    return int(arch.extra.get("shared_expert_ffn", arch.intermediate_size))


def permute_for_gguf(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF rows (halves of each head: [re..., im...]) -> llama.cpp rows (pairs: re, im, re, im)."""
    rows = t.shape[0]
    return t.reshape(n_heads, 2, rows // n_heads // 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def unpermute_from_gguf(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of `permute_for_gguf`."""
    rows = t.shape[0]
    return t.reshape(n_heads, rows // n_heads // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)
