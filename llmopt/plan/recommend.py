"""The recommendation: every candidate format's memory and speed on a budget, and one pick per use case.

For each candidate (GGUF mixes and GPTQ/AWQ checkpoints) a row adds up exact weight bytes, the KV
cache and the itemized runtime overhead per device, compares the total with the budget, and gives
the decode and prefill rooflines. A use case then picks one row:
- quality: the best-quality format that fits;
- balanced: the best quality at <= ~5.5 bits/weight (Q5_K_M and below), where llama.cpp measures
  under 0.06 perplexity loss at about a third of the 16-bit size;
- speed: the fewest bytes read per token (highest decode bound) among formats of "good" quality.
Rows that fit with less than HEADROOM_FRACTION of the budget to spare are "tight" and picked only
when nothing fits comfortably. When nothing fits, `nearest` proposes a shorter context, a smaller
model, and tensor parallelism over more devices.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from llmopt.formats.gguf.types import aligned, candidate_types, tensor_nbytes
from llmopt.plan.gpus import GPU, GIB
from llmopt.plan.gguf_file import gguf_file_bytes
from llmopt.plan.kv_cache import kv_cache_bytes
from llmopt.plan.models import PlanModel, all_presets
from llmopt.plan.overhead import Overhead, runtime_overhead
from llmopt.plan.quality import GOOD, Quality, class_index, quality
from llmopt.plan.roofline import Device, decode_bytes_per_step, decode_tokens_per_s, prefill_flops, prefill_seconds
from llmopt.plan.weights import WeightFormat, WeightSize, awq_format, gguf_format, gguf_tensor_types, gptq_format, weight_size

# AWQ's maintained kernels (AutoAWQ GEMM/GEMV, vLLM) are 4-bit only, so AWQ-8 is not offered.
CANDIDATES: tuple[WeightFormat, ...] = (
    *(gguf_format(m) for m in ("F16", "BF16", "Q8_0", "Q6_K", "Q5_K_M", "Q5_K_S", "Q4_K_M", "Q4_K_S", "Q4_0",
                               "Q3_K_L", "Q3_K_M", "Q3_K_S", "Q2_K")),
    gptq_format(8), gptq_format(4), awq_format(4),
)
USE_CASES = ("quality", "balanced", "speed")
HEADROOM_FRACTION = 0.05
BALANCED_MAX_RANK = quality("Q5_K_M").rank  # formats at or below Q5_K_M in quality order
INTERACTIVE_TOKS = 30.0  # decode tokens/s the speed pick aims for when comparing models
TP_SIZES = (2, 4, 8)


@dataclass(frozen=True)
class Workload:
    context: int = 4096
    batch: int = 1
    kv_dtype: str = "f16"
    tp: int = 1  # devices the model is split over (tensor parallel)


@dataclass(frozen=True)
class Budget:
    memory_bytes: int  # per device
    gpu: GPU | None = None
    bandwidth_gbs: float | None = None  # per device; overrides the GPU's

    def device(self, tp: int) -> Device | None:
        bw = self.bandwidth_gbs or (self.gpu.bandwidth_gbs if self.gpu else None)
        if not bw:
            return None
        return Device(bw * tp, self.gpu.bf16_tflops * tp if self.gpu else None,
                      self.gpu.int8_tops * tp if self.gpu else None)


@dataclass
class Row:
    model: str
    format: str
    kind: str
    tp: int
    parameters: int
    bits_per_weight: float
    weights_bytes: int  # whole model
    file_bytes: int | None  # GGUF file on disk
    kv_bytes: int  # whole cache
    overhead: Overhead  # per device
    total_bytes: int  # per device
    headroom_bytes: int  # per device
    fits: str  # "yes", "tight" or "no"
    bytes_per_step: int
    decode_tps: float | None  # per sequence, upper bound
    prefill_s: float | None  # lower bound for batch x context prompt tokens
    quality: Quality
    weight_types: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model, "format": self.format, "kind": self.kind, "devices": self.tp,
            "bits_per_weight": round(self.bits_per_weight, 3),
            "weights_bytes": self.weights_bytes, "file_bytes": self.file_bytes, "kv_cache_bytes": self.kv_bytes,
            "overhead_bytes": {"activations": self.overhead.activations, "logits": self.overhead.logits,
                               "device_context": self.overhead.device_context, "total": self.overhead.total},
            "total_bytes_per_device": self.total_bytes, "headroom_bytes": self.headroom_bytes, "fits": self.fits,
            "bytes_read_per_token": self.bytes_per_step,
            "decode_tokens_per_s_bound": None if self.decode_tps is None else round(self.decode_tps, 2),
            "prefill_seconds_bound": None if self.prefill_s is None else round(self.prefill_s, 4),
            "quality_class": self.quality.label, "ppl_delta_llama3_8b": self.quality.ppl_delta,
            "weight_bytes_by_type": self.weight_types,
        }  # fmt: skip


def tp_allowed(model: PlanModel, tp: int) -> bool:
    """Tensor parallel needs whole attention heads per device (KV heads split or replicated)."""
    a = model.arch
    return a.num_heads % tp == 0 and (a.num_kv_heads % tp == 0 or tp % a.num_kv_heads == 0)


def kv_bytes_per_device(model: PlanModel, kv_total: int, tp: int) -> int:
    """KV heads are split across devices; with more devices than KV heads each keeps one copy."""
    kv_heads = model.arch.num_kv_heads
    return kv_total * -(-kv_heads // tp) // kv_heads


def make_row(model: PlanModel, size: WeightSize, workload: Workload, budget: Budget) -> Row:
    arch, tp = model.arch, workload.tp
    per_seq = kv_cache_bytes(arch, workload.context, 1, workload.kv_dtype)  # sliding layers: their window
    kv_total = per_seq * workload.batch
    overhead = runtime_overhead(arch, workload.context, workload.batch, tp=tp)
    total = -(-size.total_bytes // tp) + kv_bytes_per_device(model, kv_total, tp) + overhead.total
    headroom = budget.memory_bytes - total
    fits = "no" if headroom < 0 else "tight" if headroom < HEADROOM_FRACTION * budget.memory_bytes else "yes"
    step = decode_bytes_per_step(arch, size.total_bytes, size.expert_bytes, per_seq, workload.batch)
    device = budget.device(tp)
    q = quality(size.format.name)
    prefill = None
    if device is not None:
        int8 = size.format.kind == "gguf" and size.format.name not in ("F16", "BF16")
        flops = prefill_flops(arch, model.active_parameters, workload.context, workload.batch)
        prefill = prefill_seconds(flops, device, int8)
    file_bytes = None
    if size.format.kind == "gguf":
        file_bytes = gguf_file_bytes(model.tensors, size.type_counts, model.metadata_bytes, model.alignment)
    return Row(
        model=model.name, format=size.format.name, kind=size.format.kind, tp=tp, parameters=size.parameters,
        bits_per_weight=size.bits_per_weight, weights_bytes=size.total_bytes, file_bytes=file_bytes,
        kv_bytes=kv_total, overhead=overhead, total_bytes=total, headroom_bytes=headroom, fits=fits,
        bytes_per_step=step, decode_tps=None if device is None else decode_tokens_per_s(step, device),
        prefill_s=prefill, quality=q, weight_types=dict(size.types),
    )  # fmt: skip


def plan_rows(model: PlanModel, workload: Workload, budget: Budget,
              formats: tuple[WeightFormat, ...] = CANDIDATES) -> list[Row]:
    """One row per candidate format, largest weights first."""
    rows = [make_row(model, weight_size(model.arch, model.tensors, f), workload, budget) for f in formats]
    return sorted(rows, key=lambda r: -r.weights_bytes)


def _fitting(rows: list[Row]) -> list[Row]:
    comfortable = [r for r in rows if r.fits == "yes"]
    return comfortable or [r for r in rows if r.fits == "tight"]


def pick(rows: list[Row], use_case: str) -> Row | None:
    """The row a use case recommends, or None when nothing fits."""
    fitting = _fitting(rows)
    if not fitting:
        return None
    by_quality = sorted(fitting, key=lambda r: (r.quality.rank, -r.weights_bytes))
    if use_case == "quality":
        return by_quality[0]
    if use_case == "balanced":
        capped = [r for r in by_quality if r.quality.rank >= BALANCED_MAX_RANK]
        return (capped or by_quality)[0]
    good = [r for r in fitting if class_index(r.quality.label) <= GOOD] or fitting
    return min(good, key=lambda r: (r.bytes_per_step, r.quality.rank))


def reason(row: Row, use_case: str, budget: Budget) -> str:
    """One sentence on why this row was picked."""
    mem = f"{row.total_bytes / GIB:.1f} of {budget.memory_bytes / GIB:.1f} GiB per device, {row.headroom_bytes / GIB:.1f} GiB to spare"
    loss = f"llama.cpp measures +{row.quality.ppl_delta} perplexity for it on Llama-3-8B" if row.quality.ppl_delta else f"{row.quality.label} quality"
    speed = f"decode at most {row.decode_tps:.0f} tok/s" if row.decode_tps else f"{row.bytes_per_step / GIB:.2f} GiB read per token"
    if use_case == "quality":
        return f"{row.model} {row.format} is the highest-quality format that fits ({mem}); {loss}."
    if use_case == "balanced":
        return f"{row.model} {row.format} is the best quality at <= 5.5 bits/weight ({row.bits_per_weight:.2f} bpw, {mem}); {loss}."
    among = "good-quality formats" if class_index(row.quality.label) <= GOOD else "the formats that fit (none of good quality does)"
    return f"{row.model} {row.format} reads the fewest bytes per token among {among} ({speed}; {mem})."


# ---------------------------------------------------------------- when nothing fits
def max_context(model: PlanModel, fmt: WeightFormat, workload: Workload, budget: Budget) -> int | None:
    """The longest context (a multiple of 256, up to the requested one) at which `fmt` fits comfortably."""
    size = weight_size(model.arch, model.tensors, fmt)
    lo, hi = 0, workload.context // 256
    while lo < hi:  # largest k with a comfortable fit at k*256 tokens
        mid = (lo + hi + 1) // 2
        if make_row(model, size, replace(workload, context=mid * 256), budget).fits == "yes":
            lo = mid
        else:
            hi = mid - 1
    return lo * 256 if lo else None


def smallest_good_format(model: PlanModel) -> WeightFormat:
    """The candidate of at least "good" quality with the fewest weight bytes."""
    good = [f for f in CANDIDATES if class_index(quality(f.name).label) <= GOOD]
    return min(good, key=lambda f: weight_size(model.arch, model.tensors, f).total_bytes)


def nearest(model: PlanModel, workload: Workload, budget: Budget) -> list[dict[str, Any]]:
    """Ways to make it fit: shorter context, a smaller model, or more devices."""
    options: list[dict[str, Any]] = []
    fmt = smallest_good_format(model)
    ctx = max_context(model, fmt, workload, budget)
    if ctx:
        options.append({"kind": "shorter context", "model": model.name, "format": fmt.name, "context": ctx,
                        "text": f"{model.name} {fmt.name} fits at a context of {ctx} tokens (asked {workload.context})"})
    smaller = sorted((m for m in all_presets() if m.parameters < model.parameters), key=lambda m: -m.parameters)
    for m in smaller:
        row = pick(plan_rows(m, workload, budget), "quality")
        if row is not None and class_index(row.quality.label) <= GOOD:
            options.append({"kind": "smaller model", "model": m.name, "format": row.format,
                            "text": f"{m.name} ({m.parameters / 1e9:.1f}B) fits at {row.format} "
                                    f"({row.total_bytes / GIB:.1f} GiB)"})
            break
    for tp in TP_SIZES:
        if tp <= workload.tp or not tp_allowed(model, tp):
            continue
        row = pick(plan_rows(model, replace(workload, tp=tp), budget), "quality")
        if row is not None and class_index(row.quality.label) <= GOOD:
            options.append({"kind": "more devices", "model": model.name, "format": row.format, "devices": tp,
                            "text": f"{model.name} {row.format} fits with tensor parallel over {tp} devices "
                                    f"({row.total_bytes / GIB:.1f} GiB each)"})
            break
    return options


# ---------------------------------------------------------------- the two modes
def automatic_gguf(model: PlanModel, workload: Workload, budget: Budget) -> dict[str, Any] | None:
    """The GGUF file size `convert --target-size` should aim at to fill the budget with room to
    spare (HEADROOM_FRACTION), or None when F16 fits anyway or not even the smallest types fit."""
    tp = workload.tp
    kv = kv_bytes_per_device(model, kv_cache_bytes(model.arch, workload.context, workload.batch, workload.kv_dtype), tp)
    overhead = runtime_overhead(model.arch, workload.context, workload.batch, tp=tp)
    room = (int(budget.memory_bytes * (1 - HEADROOM_FRACTION)) - kv - overhead.total) * tp  # whole-model weights
    f16 = weight_size(model.arch, model.tensors, gguf_format("F16"))
    f16_types = gguf_tensor_types(model.arch, model.tensors, "F16")
    header = gguf_file_bytes(model.tensors, f16.type_counts, model.metadata_bytes, model.alignment) - sum(
        aligned(tensor_nbytes(f16_types[t.gguf_name], t.shape), model.alignment) for t in model.tensors)
    least = sum(aligned(tensor_nbytes(f16_types[t.gguf_name], t.shape), model.alignment)
                if f16_types[t.gguf_name] == "F32" else
                min(aligned(tensor_nbytes(c, t.shape), model.alignment) for c in candidate_types(t.shape))
                for t in model.tensors)  # fmt: skip
    if room >= f16.total_bytes or room < least:
        return None
    return {"target_size_bytes": header + room, "bits_per_weight": round(8 * room / f16.parameters, 3),
            "smallest_file_bytes": header + least}  # fmt: skip


def recommend_for_model(model: PlanModel, workload: Workload, budget: Budget,
                        use_cases: tuple[str, ...] = USE_CASES) -> dict[str, Any]:
    """Every candidate for one model, one pick per use case, the automatic GGUF mix that fills the
    budget, and fixes when nothing fits."""
    rows = plan_rows(model, workload, budget)
    picks = {}
    for uc in use_cases:
        row = pick(rows, uc)
        if row is not None:
            picks[uc] = {"format": row.format, "model": row.model, "reason": reason(row, uc, budget)}
    return {
        "mode": "model",
        "models": [_model_info(model, workload)],
        "candidates": rows,
        "recommendations": picks,
        "nearest": [] if picks else nearest(model, workload, budget),
        "automatic": automatic_gguf(model, workload, budget),
    }


def recommend_over_presets(workload: Workload, budget: Budget,
                           use_cases: tuple[str, ...] = USE_CASES) -> dict[str, Any]:
    """Which known model, at which format, for each use case: the largest model a use case allows."""
    models = sorted(all_presets(), key=lambda m: m.parameters)
    best: list[Row] = []
    per_model: dict[str, list[Row]] = {}
    for m in models:
        rows = plan_rows(m, workload, budget)
        per_model[m.name] = rows
        row = pick(rows, "quality") or min(rows, key=lambda r: r.total_bytes)
        best.append(row)
    picks: dict[str, dict[str, Any]] = {}
    for uc in use_cases:
        row = _largest_for(models, per_model, uc)
        if row is not None:
            picks[uc] = {"format": row.format, "model": row.model, "reason": _over_reason(row, uc, budget)}
            if row not in best:  # a pick in another format than the model's best row: show it too
                best.insert(best.index(next(r for r in best if r.model == row.model)) + 1, row)
    return {
        "mode": "presets",
        "models": [_model_info(m, workload) for m in models],
        "candidates": best,
        "recommendations": picks,
        "nearest": [],
    }


def _largest_for(models: list[PlanModel], per_model: dict[str, list[Row]], use_case: str) -> Row | None:
    """The pick of the largest model whose pick for this use case meets the use case's bar."""
    for m in reversed(models):
        row = pick(per_model[m.name], use_case)
        if row is None:
            continue
        label = class_index(row.quality.label)
        if use_case == "quality" and label <= GOOD:
            return row
        if use_case == "balanced" and label <= class_index("very good"):
            return row
        if use_case == "speed" and label <= GOOD and (row.decode_tps is None or row.decode_tps >= INTERACTIVE_TOKS):
            if row.decode_tps is not None or _is_balanced_size(models, per_model, m):
                return row
    return None


def _is_balanced_size(models: list[PlanModel], per_model: dict[str, list[Row]], m: PlanModel) -> bool:
    """Without a bandwidth, the speed pick stays on the balanced model (just its fastest format)."""
    chosen = _largest_for(models, per_model, "balanced")
    return chosen is not None and chosen.model == m.name


def _over_reason(row: Row, use_case: str, budget: Budget) -> str:
    mem = f"{row.total_bytes / GIB:.1f} of {budget.memory_bytes / GIB:.1f} GiB"
    if use_case == "quality":
        return f"{row.model} is the largest known model that fits at good quality or better: {row.format}, {mem}."
    if use_case == "balanced":
        return f"{row.model} is the largest known model that fits at very good quality ({row.format}, {mem}), leaving room to spare."
    if row.decode_tps is not None:
        return f"{row.model} {row.format} is the largest known model whose decode bound reaches {INTERACTIVE_TOKS:.0f} tok/s ({row.decode_tps:.0f} tok/s, {mem})."
    return f"{row.model} {row.format}: the balanced model in its fastest good format ({mem}); give --gpu or --bandwidth to rank by speed."


def _model_info(model: PlanModel, workload: Workload) -> dict[str, Any]:
    a = model.arch
    return {
        "name": model.name, "origin": model.origin, "family": a.family.name,
        "parameters": model.parameters, "active_parameters": model.active_parameters,
        "layers": a.num_layers, "hidden_size": a.hidden_size, "heads": a.num_heads, "kv_heads": a.num_kv_heads,
        "head_dim": a.head_dim, "vocab_size": a.vocab_size, "experts": a.extra.get("num_experts", 0),
        "experts_per_token": a.extra.get("experts_per_token", 0),
        "kv_cache_bytes": kv_cache_bytes(a, workload.context, workload.batch, workload.kv_dtype),
        "gguf_metadata_bytes": model.metadata_bytes, "gguf_metadata_exact": model.metadata_exact,
    }  # fmt: skip

