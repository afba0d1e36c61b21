"""Write a model as a GGUF file llama.cpp loads: plan every tensor's type, then stream them one by one.

The header (metadata and tensor infos) is written first from the plan, since every tensor's size is
known from its type; then each tensor is read from the source, permuted where llama.cpp wants it,
quantized on its grid, packed into llama.cpp's blocks and appended. Only one tensor is in memory at
a time, and the file appears under its name only when complete.

`GGUFWriter` is also a sink for the quantization pipeline: tensors whose codes a method computed
(GPTQ onto a GGUF grid) are handed in block by block (`add`) and packed as they are, without
re-rounding; the rest still come from the source. `write_gguf` is the plain conversion.
"""

from __future__ import annotations

import itertools
import math
import re
import struct
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

import llmopt
from llmopt.errors import InputError
from llmopt.formats.atomic import AtomicFile
from llmopt.formats.gguf.blocks import pack
from llmopt.formats.gguf.mixes import IMATRIX_TYPES, check_mix, file_type, gguf_shapes, plan_shapes, requires_imatrix
from llmopt.formats.gguf.types import aligned, ggml_type, tensor_nbytes
from llmopt.formats.gguf.vocab import vocab_metadata
from llmopt.model.arch import ArchSpec
from llmopt.model.families.base import permute_for_gguf
from llmopt.model.rope import attention_factor, gguf_only_values, longrope_original_context, rope_kind
from llmopt.model.source import ModelSource
from llmopt.quant.grids import GRIDS, Grid, quantize
from llmopt.quant.grids.iq_lattice import imatrix_required
from llmopt.quant.grids.layout import single_threaded_ops
from llmopt.quant.pipeline import BlockResult
from llmopt.quantized_tensor import QuantizedTensor

QUANTIZATION_VERSION = 2  # GGML_QNT_VERSION: the block layouts written here
# The writer lets the source drop the file pages it read once this many bytes were read since the last
# time (or after a larger tensor): resident memory stays within one tensor plus this, and small tensors
# do not each pay for re-reading the process's maps and re-faulting the next one's pages.
RELEASE_BYTES = 64 << 20
# float32 bytes of a big tensor's rows read and encoded at once (_encode_slabs)
SLAB_BYTES = 32 << 20
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class PlannedTensor:
    gguf_name: str
    hf_name: str | None  # None for tensors computed from the config (llama3 rope_freqs)
    shape: tuple[int, ...]  # HF orientation; GGUF stores the reverse
    type_name: str
    source_nbytes: int
    parts: tuple[str, ...] = ()  # the source tensors it stacks by rows (Phi-3's attn_qkv: q, k, v), if fused

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.type_name, self.shape)


@dataclass
class GgufPlan:
    mix: str
    tensors: list[PlannedTensor]
    header_nbytes: int = 0
    alignment: int = gguf.GGUF_DEFAULT_ALIGNMENT
    metadata: dict[str, Any] = field(default_factory=dict)
    header: bytes = field(default=b"", repr=False)  # the rendered header, reused by write_gguf
    header_key: tuple = field(default=(), repr=False)  # what it was rendered from

    def key(self) -> tuple:
        return (tuple(self.tensors), repr(self.metadata), self.alignment)

    @property
    def data_nbytes(self) -> int:
        return sum(aligned(t.nbytes, self.alignment) for t in self.tensors)

    @property
    def file_nbytes(self) -> int:
        """The exact size of the file `write_gguf` produces for this plan."""
        return aligned(self.header_nbytes, self.alignment) + self.data_nbytes

    def types_count(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for t in self.tensors:
            counts[t.type_name] = counts.get(t.type_name, 0) + 1
        return counts


@dataclass
class Provenance:
    """What goes into the file about how it was made (llmopt.* and llama.cpp's quantize.imatrix.* keys)."""

    command: str | None = None
    name: str | None = None  # general.name (default: the source's file or folder name)
    imatrix_file: str | None = None
    imatrix_datasets: list[str] = field(default_factory=list)
    imatrix_entries: int | None = None
    imatrix_chunks: int | None = None
    extra: dict[str, str] = field(default_factory=dict)  # more llmopt.* keys: the method, the automatic mix


def plan_gguf(
    source: ModelSource,
    mix: str,
    *,
    overrides: Sequence[tuple[str, str]] = (),
    output_tensor_type: str | None = None,
    has_imatrix: bool = False,
    provenance: Provenance | None = None,
) -> GgufPlan:
    """Every tensor's GGUF name, shape and type, and the exact file size, without writing anything."""
    mix = check_mix(mix)
    shapes = gguf_shapes(source)
    types = plan_shapes(shapes, mix, source.arch, overrides=overrides, has_imatrix=has_imatrix,
                        output_tensor_type=output_tensor_type)  # fmt: skip
    family = source.arch.family
    stored = family.stored_names(source.tensors, stack_experts=True)  # a fused linear (attn_qkv), an expert stack
    # (ffn_gate_exps) hold several source tensors
    by_gguf = {family.hf_to_gguf_name(n): n for n in stored}
    tensors = []
    for name in shapes:
        parts = stored[by_gguf[name]]
        tensors.append(PlannedTensor(name, by_gguf[name], shapes[name], types[name],
                                     sum(source.tensors[p].nbytes for p in parts),
                                     tuple(parts) if parts != [by_gguf[name]] else ()))  # fmt: skip
    for name, values in reversed(gguf_only_values(source.arch).items()):  # after token_embd, as llama.cpp's rope_freqs
        tensors.insert(1, PlannedTensor(name, None, tuple(values.shape), "F32", 0))
    plan = GgufPlan(mix=mix, tensors=tensors, metadata=gguf_metadata(source, mix, provenance or Provenance()))
    plan.header = _render_header(source, plan)
    plan.header_nbytes, plan.header_key = len(plan.header), plan.key()
    return plan


class GGUFWriter:
    """A GGUF file written tensor by tensor in plan order, atomically.

    Every tensor comes from the source, quantized on its planned grid, unless it is one of
    `computed` (HF module names): those wait for the pipeline's result, handed in with `add`, and
    are packed from the codes it holds. With a pipeline feeding it, a block's other tensors wait for
    the block too: a method may have changed them (AWQ's norms, in `BlockResult.updated`).
    `finish()` writes what is left and moves the file into place.
    """

    def __init__(self, source: ModelSource, output: Path, plan: GgufPlan, *,
                 importance: Mapping[str, torch.Tensor] | None = None, computed: Sequence[str] = (),
                 force: bool = True, on_tensor: Callable[[PlannedTensor, float], None] | None = None):  # fmt: skip
        self.source, self.plan, self.importance, self.on_tensor = source, plan, importance, on_tensor
        self.computed = set(computed)
        _check_importance(plan, importance, self.computed)
        self.held: dict[str, QuantizedTensor] = {}
        self.updated: dict[str, torch.Tensor] = {}
        self.layers_added: set[int] = set()
        self.next = 0
        self.read_since_release = 0  # bytes of the source read since its file pages were last dropped
        header = plan.header if plan.header and plan.header_key == plan.key() else _render_header(source, plan)
        self.out = AtomicFile(Path(output), force, planned_bytes=aligned(len(header), plan.alignment) + plan.data_nbytes)
        self.file = open(self.out.tmp, "wb")
        self.path: Path | None = None
        self.file.write(header)  # then each tensor at the next multiple of the alignment, as GGUFWriter does
        _load_kernels_first(plan, weighted=importance is not None)

    def add(self, block: BlockResult) -> None:
        """Take one block's results; write every tensor whose turn has come."""
        self.held.update(block.tensors)
        self.updated.update(block.updated)
        self.layers_added.add(block.layer)
        self._write_ready()

    def _ready(self, planned: PlannedTensor) -> bool:
        if not self.computed or planned.hf_name is None:
            return True
        modules = _modules(planned)
        if any(m in self.computed for m in modules):
            return all(m in self.held for m in modules)
        m = _HF_LAYER.match(planned.hf_name)
        return m is None or int(m.group(1)) in self.layers_added

    def _write_ready(self, final: bool = False) -> None:
        f = self.file
        while self.next < len(self.plan.tensors):
            planned = self.plan.tensors[self.next]
            if not final and not self._ready(planned):
                return  # its block has not been added yet
            modules = _modules(planned)
            start = time.perf_counter()
            self.source.check_unchanged()  # before reading it: a file replaced mid-run is one line, not a mixed output
            if any(m in self.computed for m in modules):
                if not all(m in self.held and m in self.computed for m in modules):
                    raise RuntimeError(f"{planned.gguf_name}: the pipeline produced no result for it")
                data = encode_computed(self.source, planned, QuantizedTensor.stack_rows([self.held.pop(m) for m in modules]))
            else:
                importance = None if self.importance is None else self.importance.get(planned.gguf_name)
                weight = self._updated(planned)
                self.read_since_release += planned.source_nbytes
                release = self.read_since_release >= RELEASE_BYTES
                with single_threaded_ops():  # small ops: threads inside each op cost more than they gain
                    data = encode_tensor(self.source, planned, importance, weight, release=release)
                if release:
                    self.read_since_release = 0
            if data.nbytes != planned.nbytes:
                raise InputError(f"{planned.gguf_name}: encoded {data.nbytes} bytes, planned {planned.nbytes}")
            f.write(bytes(aligned(f.tell(), self.plan.alignment) - f.tell()))
            f.write(memoryview(np.ascontiguousarray(data)).cast("B"))  # through the file object (not its descriptor)
            del data
            self.next += 1
            if self.on_tensor is not None:
                self.on_tensor(planned, time.perf_counter() - start)

    def _updated(self, planned: PlannedTensor) -> torch.Tensor | None:
        """The tensor as a method changed it, if it did (a fused one: its parts, changed or not, stacked)."""
        if planned.hf_name is None:
            return None
        if not planned.parts:
            return self.updated.pop(planned.hf_name, None)
        if not any(p in self.updated for p in planned.parts):
            return None
        parts = [self.updated.pop(p, None) if p in self.updated else self.source.load(p) for p in planned.parts]
        return (torch.stack if self.source.arch.family.is_stack(planned.hf_name) else torch.cat)(parts)

    def finish(self) -> Path:
        self._write_ready(final=True)
        self.file.write(bytes(aligned(self.file.tell(), self.plan.alignment) - self.file.tell()))
        self.file.close()
        self.source.check_unchanged()
        self.path = self.out.commit()
        return self.path

    def __enter__(self) -> GGUFWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.path is None:  # failed, or left without finish(): nothing under the final name
            self.file.close()
            self.out.discard()


def _load_kernels_first(plan: GgufPlan, weighted: bool) -> None:
    """Quantize one small row of each planned type before the first tensor (with an importance vector
    where the write has one or the type needs one), so that the compiled kernels every search runs on
    (grids/compiled.py: numba's import and cache, ~0.25 s a process) are loaded before the first
    tensor's clock starts, not inside it."""
    probe = torch.randn(1, 256, generator=torch.Generator().manual_seed(0))
    for type_name in sorted({t.type_name for t in plan.tensors} - {"F32", "F16", "BF16"}):
        with single_threaded_ops():
            quantize(type_name, probe, torch.ones(256) if weighted or type_name in IMATRIX_TYPES else None)


def _check_importance(plan: GgufPlan, importance: Mapping[str, torch.Tensor] | None, computed: set[str]) -> None:
    """llama-quantize's refusal, made before a byte is written: a very-low-bit i-quant tensor that
    we round here (not one a calibrated method computed) needs its own importance-matrix entry."""
    for t in plan.tensors:
        if (requires_imatrix(t.gguf_name, t.type_name, plan.mix) and (importance is None or t.gguf_name not in importance)
                and not any(m in computed for m in _modules(t))):  # fmt: skip
            # (a type that needs one only in some mixes, Q2_K in Q2_K_S, is named with its mix)
            raise imatrix_required(t.type_name if t.type_name in IMATRIX_TYPES else f"{plan.mix}'s {t.type_name}", t.gguf_name)


def _modules(planned: PlannedTensor) -> list[str]:
    """The source modules whose results make up a planned tensor (a fused one: each part's)."""
    return [p.removesuffix(".weight") for p in (planned.parts or ((planned.hf_name,) if planned.hf_name else ()))]


def grids_for(plan: GgufPlan) -> Callable[[str], Grid]:
    """The grid each module's codes must land on for `plan`: what a method that rounds by itself
    (GPTQ onto a GGUF grid) is given as `QuantizeSpec.grids`, so the file gets the plan's types."""
    types = {part.removesuffix(".weight"): t.type_name for t in plan.tensors if t.hf_name
             for part in (t.parts or (t.hf_name,))}  # fmt: skip

    def grid(module: str) -> Grid:
        type_name = types.get(module)
        if type_name is None:
            raise InputError(f"{module}: not in the GGUF plan")
        if type_name not in GRIDS:
            raise InputError(f"{module} is planned as {type_name}, which no method rounds onto")
        return GRIDS[type_name]

    return grid


def write_gguf(
    source: ModelSource,
    output: Path,
    plan: GgufPlan,
    *,
    importance: Mapping[str, torch.Tensor] | None = None,
    force: bool = True,
    on_tensor: Callable[[PlannedTensor, float], None] | None = None,
) -> Path:
    """Write `plan` for `source` to `output` (atomically), quantizing with `importance` where given."""
    with GGUFWriter(source, output, plan, importance=importance, force=force, on_tensor=on_tensor) as writer:
        return writer.finish()


def encode_tensor(source: ModelSource, planned: PlannedTensor, importance: torch.Tensor | None = None,
                  weight: torch.Tensor | None = None, release: bool = True) -> np.ndarray:  # fmt: skip
    """One tensor's bytes in its planned type: loaded (or `weight`, where a method changed it),
    permuted for llama.cpp, quantized and packed; `release`: the source's file pages are dropped after."""
    if planned.hf_name is None:
        return gguf_only_values(source.arch)[planned.gguf_name].numpy()
    if weight is not None:
        return _encode(source, planned, weight.to(torch.float32), importance)
    try:
        if _in_slabs(source, planned):
            return _encode_slabs(source, planned, importance, release)
        # float32 straight from the file's map (one conversion, no intermediate copy); other dtypes as stored
        return _encode(source, planned, source.load_stored(planned.hf_name, "float32"), importance)
    finally:
        if release:
            source.release_pages()  # the file pages it was read from need not stay resident


def _in_slabs(source: ModelSource, planned: PlannedTensor) -> bool:
    """Whether a tensor is encoded a slab of rows at a time: a plain 2-D tensor (every GGML type rounds
    each row on its own) bigger than one slab, whose rows llama.cpp does not permute."""
    name, arch = planned.hf_name, source.arch
    info = source.tensors.get(name or "")
    return (info is not None and len(info.shape) == 2 and math.prod(info.shape) * 4 > SLAB_BYTES
            and arch.family.qk_heads(name, arch.num_heads, arch.num_kv_heads) is None
            and not arch.family.gguf_shift(name))


def _encode_slabs(source: ModelSource, planned: PlannedTensor, importance: torch.Tensor | None,
                  release: bool) -> np.ndarray:  # fmt: skip
    """The bytes of `planned`, read and encoded SLAB_BYTES of float32 rows at a time, so the writer never
    holds a whole big tensor in float32 (a 7B model's embeddings: 500 MB)."""
    rows, cols = source.tensors[planned.hf_name].shape
    step = max(1, SLAB_BYTES // (4 * cols))
    out, at = np.empty(planned.nbytes, dtype=np.uint8), 0
    for start in range(0, rows, step):
        slab = source.load_rows(planned.hf_name, slice(start, start + step), "float32")
        part = _encode(source, planned, slab, importance).reshape(-1).view(np.uint8)
        del slab
        if at + part.nbytes > out.nbytes:
            raise InputError(f"{planned.gguf_name}: encoded more than the {planned.nbytes} bytes planned")
        out[at:at + part.nbytes] = part
        at += part.nbytes
        if release:
            source.release_pages()
    return out if at == out.nbytes else out[:at]


def _encode(source: ModelSource, planned: PlannedTensor, weight: torch.Tensor,
            importance: torch.Tensor | None) -> np.ndarray:  # fmt: skip
    arch = source.arch
    heads = arch.family.qk_heads(planned.hf_name, arch.num_heads, arch.num_kv_heads)
    if heads is not None:
        weight = permute_for_gguf(weight, heads)
    shift = arch.family.gguf_shift(planned.hf_name)
    if shift:  # Gemma's norms: llama.cpp reads shift + w
        weight = weight + shift
    kind = planned.type_name
    if kind == "F32":
        return weight.contiguous().numpy()
    if kind == "F16":
        return weight.to(torch.float16).contiguous().numpy()
    if kind == "BF16":
        return weight.to(torch.bfloat16).contiguous().view(torch.uint8).numpy()
    if importance is not None and not _per_expert(weight, importance) and importance.numel() != weight.shape[-1]:
        raise InputError(f"imatrix entry for {planned.gguf_name} has {importance.numel()} values, "
                         f"the tensor has {weight.shape[-1]} columns")  # fmt: skip
    return pack(quantize_stored(kind, weight, importance))


def quantize_stored(type_name: str, weight: torch.Tensor, importance: torch.Tensor | None) -> QuantizedTensor:
    """A tensor as stored (2-D, or an expert stack [experts, rows, cols]) rounded onto `type_name`'s grid,
    rows in order; a stack's experts each with their own row of a per-expert imatrix, as llama-quantize."""
    if importance is not None and _per_expert(weight, importance):
        rows = importance.reshape(weight.shape[0], -1)
        return QuantizedTensor.stack_rows([quantize(type_name, w, i) for w, i in zip(weight, rows)])
    return quantize(type_name, weight.reshape(-1, weight.shape[-1]), importance)


def _per_expert(weight: torch.Tensor, importance: torch.Tensor) -> bool:
    return weight.dim() == 3 and weight.shape[0] > 1 and importance.numel() == weight.shape[0] * weight.shape[-1]


def encode_computed(source: ModelSource, planned: PlannedTensor, qt: QuantizedTensor) -> np.ndarray:
    """The bytes of a tensor whose codes a method computed: checked against the plan, rows permuted
    for llama.cpp, packed as they are."""
    if qt.grid != planned.type_name:
        raise InputError(f"{planned.gguf_name}: quantized onto {qt.grid}, but the plan says {planned.type_name}")
    if qt.shape != (math.prod(planned.shape[:-1]), planned.shape[-1]):  # an expert stack: its experts' rows in order
        raise InputError(f"{planned.gguf_name}: quantized shape {qt.shape}, planned {tuple(planned.shape)}")
    arch = source.arch
    heads = arch.family.qk_heads(planned.hf_name or "", arch.num_heads, arch.num_kv_heads)
    if heads is not None:
        qt = qt.take_rows(permute_for_gguf(torch.arange(qt.shape[0]), heads))
    return pack(qt)


# ------------------------------------------------------------------------------------------ metadata
def gguf_metadata(source: ModelSource, mix: str, provenance: Provenance) -> dict[str, Any]:
    """Summary of what the header says (for --dry-run and reports); the writer adds the same keys."""
    return {
        "general.architecture": source.arch.family.gguf_arch,
        **({"general.name": provenance.name} if provenance.name else {}),
        "general.file_type": file_type(mix),
        "general.quantization_version": QUANTIZATION_VERSION,
        "llmopt.version": llmopt.__version__,
        **({"llmopt.command": provenance.command} if provenance.command else {}),
        **_imatrix_keys(provenance),
        **provenance.extra,
    }


def _imatrix_keys(p: Provenance) -> dict[str, Any]:
    keys: dict[str, Any] = {}
    if p.imatrix_file is not None:
        keys["quantize.imatrix.file"] = p.imatrix_file
    if p.imatrix_datasets:
        keys["quantize.imatrix.dataset"] = p.imatrix_datasets[0]
    if p.imatrix_entries is not None:
        keys["quantize.imatrix.entries_count"] = p.imatrix_entries
    if p.imatrix_chunks is not None:
        keys["quantize.imatrix.chunks_count"] = p.imatrix_chunks
    return keys


class _Writer(gguf.GGUFWriter):
    """GGUFWriter with a fast path for long metadata arrays of str, int or float (the vocabulary):
    the same bytes as its item-by-item packing, made in a few C-level passes."""

    def _pack_val(self, val: Any, vtype: gguf.GGUFValueType, add_vtype: bool,
                  sub_type: gguf.GGUFValueType | None = None) -> bytes:  # fmt: skip
        fast = None
        if vtype == gguf.GGUFValueType.ARRAY and isinstance(val, (list, tuple)) and len(val) > 16 \
                and sub_type is None and self.endianess == gguf.GGUFEndian.LITTLE:  # fmt: skip
            kinds = set(map(type, val))
            if kinds == {str}:
                encoded = [v.encode("utf-8") for v in val]
                lengths = map(struct.Struct("<Q").pack, map(len, encoded))
                fast = gguf.GGUFValueType.STRING, b"".join(itertools.chain.from_iterable(zip(lengths, encoded)))
            elif kinds == {int}:
                fast = gguf.GGUFValueType.INT32, np.asarray(val, dtype="<i4").tobytes()
            elif kinds == {float}:
                fast = gguf.GGUFValueType.FLOAT32, np.asarray(val, dtype="<f4").tobytes()
        if fast is None:
            return super()._pack_val(val, vtype, add_vtype, sub_type)
        head = struct.pack("<I", vtype) if add_vtype else b""
        return head + struct.pack("<IQ", fast[0], len(val)) + fast[1]


def _open_writer(path: Path, source: ModelSource, plan: GgufPlan) -> gguf.GGUFWriter:
    writer = _Writer(path, source.arch.family.gguf_arch)
    _add_header(writer, source.arch, plan, source)
    for t in plan.tensors:
        dtype = np.dtype(np.float16) if t.type_name == "F16" else np.dtype(np.float32)
        writer.add_tensor_info(t.gguf_name, t.shape, dtype, t.nbytes, raw_dtype=ggml_type(t.type_name))
    return writer


def _add_header(w: gguf.GGUFWriter, arch: ArchSpec, plan: GgufPlan, source: ModelSource) -> None:
    meta = plan.metadata
    w.add_name(plan.metadata.get("general.name") or source.path.name.removesuffix(".gguf"))
    w.add_file_type(meta["general.file_type"])
    w.add_quantization_version(QUANTIZATION_VERSION)
    w.add_string(gguf.Keys.General.QUANTIZED_BY, f"llmopt {llmopt.__version__}")
    for key, value in meta.items():
        if key.startswith("llmopt.") or key.startswith("quantize.imatrix."):
            if isinstance(value, int):
                w.add_uint32(key, value)
            else:
                w.add_string(key, str(value))
    _add_architecture(w, arch)
    info = source.tokenizer()
    if info is not None:
        _add_tokenizer(w, info, arch.vocab_size)


def _add_architecture(w: gguf.GGUFWriter, arch: ArchSpec) -> None:
    w.add_context_length(arch.max_position_embeddings)
    w.add_embedding_length(arch.hidden_size)
    w.add_block_count(arch.num_layers)
    w.add_feed_forward_length(arch.intermediate_size)
    w.add_head_count(arch.num_heads)
    w.add_head_count_kv(arch.num_kv_heads)
    w.add_rope_freq_base(arch.rope_theta)
    w.add_layer_norm_rms_eps(arch.rms_norm_eps)
    w.add_vocab_size(arch.vocab_size)
    w.add_rope_dimension_count(arch.head_dim)
    if arch.head_dim * arch.num_heads != arch.hidden_size:
        w.add_key_length(arch.head_dim)
        w.add_value_length(arch.head_dim)
    scaling = arch.rope_scaling or {}
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(scaling["factor"]))
    elif kind == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(scaling["factor"]))
        if "original_max_position_embeddings" in scaling:
            w.add_rope_scaling_orig_ctx_len(int(scaling["original_max_position_embeddings"]))
    elif rope_kind(arch) == "longrope":  # as llama.cpp's converter: no type; the factors are tensors
        w.add_rope_scaling_attn_factors(attention_factor(arch))
        w.add_rope_scaling_orig_ctx_len(longrope_original_context(arch))
    for key, value in arch.family.gguf_keys(arch).items():  # the family's own (Gemma 3's sliding window)
        w.add_key_value(f"{arch.family.gguf_arch}.{key}", value, _value_type(value),
                        sub_type=gguf.GGUFValueType.BOOL if isinstance(value, list) else None)


def _value_type(value: Any) -> gguf.GGUFValueType:
    """GGUF's type for a family key: uint32 counts, float32 numbers, arrays (of bools)."""
    if isinstance(value, list):
        return gguf.GGUFValueType.ARRAY
    return gguf.GGUFValueType.FLOAT32 if isinstance(value, float) else gguf.GGUFValueType.UINT32


def _add_tokenizer(w: gguf.GGUFWriter, info: Any, vocab_size: int) -> None:
    v = vocab_metadata(info, vocab_size)
    w.add_tokenizer_model(v.model)
    if v.pre is not None:
        w.add_tokenizer_pre(v.pre)
    w.add_token_list(v.tokens)
    w.add_token_types(v.token_types)
    if v.merges is not None:
        w.add_token_merges(v.merges)
    if v.scores is not None:
        w.add_token_scores(v.scores)
    w.add_add_space_prefix(v.add_space_prefix)
    for token, add in ((info.bos_token, w.add_bos_token_id), (info.eos_token, w.add_eos_token_id),
                       (info.unk_token, w.add_unk_token_id), (info.pad_token, w.add_pad_token_id)):  # fmt: skip
        token_id = info.token_id(token)
        if token_id is not None:
            add(token_id)
    w.add_add_bos_token(info.add_bos)
    w.add_add_eos_token(info.add_eos)
    if info.chat_template:
        w.add_chat_template(info.chat_template)


def _render_header(source: ModelSource, plan: GgufPlan) -> bytes:
    """The header (metadata + tensor infos, unpadded) as GGUFWriter writes it, via a scratch file."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "header.gguf"
        writer = _open_writer(path, source, plan)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        writer.close()
        return path.read_bytes()
