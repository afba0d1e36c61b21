"""`recommend`: which model and format fit a memory budget, and how fast they can run."""

from __future__ import annotations

import re
from typing import Any

from llmopt.errors import OptionError
from llmopt.plan.gpus import GIB, get_gpu
from llmopt.plan.kv_cache import check_kv_dtype
from llmopt.plan.models import PlanModel, find_preset, from_params, parse_params, resolve_model
from llmopt.plan.recommend import USE_CASES, Budget, Workload, recommend_for_model, recommend_over_presets, tp_allowed

_MEM = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(gib|gb|g)?\s*$", re.IGNORECASE)


def parse_mem(text: str | float) -> int:
    """"48", "48GB", "48GiB" (or the number 48 from Python) -> bytes. GPU memory is sold in GiB
    ("24 GB" cards hold 24 GiB)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        text = repr(text)
    m = _MEM.match(text) if isinstance(text, str) else None
    if not m or float(m.group(1)) <= 0:
        raise OptionError(f"bad <mem> {text!r}: give a positive memory size in GiB, such as 24 or 80GB")
    return int(float(m.group(1)) * GIB)


def recommend(*, mem: str | float | None = None, model: str | None = None, params: str | None = None, context: int = 4096,
              batch: int = 1, kv_dtype: str = "f16", gpu: str | None = None, bandwidth: float | None = None,
              tp: int = 1, use_case: str | None = None) -> dict[str, Any]:  # fmt: skip
    """Every candidate format of `model` (or of every preset) under the budget, with exact sizes,
    KV cache, overheads and decode rooflines; the pick per use case (quality, balanced, speed).
    `rows` holds the candidates as objects (the `candidates` entry is their JSON)."""
    gpu_spec = get_gpu(gpu) if gpu else None
    if mem is None and gpu_spec is None:
        raise OptionError("give <mem> (GiB per device) or <gpu> (its memory is used)")
    memory = parse_mem(mem) if mem is not None else gpu_spec.memory_bytes
    if bandwidth is not None and not bandwidth > 0:
        raise OptionError(f"bad <bandwidth> {bandwidth}: give a positive GB/s figure")
    for name, value in (("context", context), ("batch", batch), ("tp", tp)):
        if value < 1:
            raise OptionError(f"bad <{name}> {value}: must be at least 1")
    use_cases = USE_CASES
    if use_case is not None:
        if use_case.lower() not in USE_CASES:
            raise OptionError(f"unknown <use_case> {use_case!r}; choose one of: {', '.join(USE_CASES)}")
        use_cases = (use_case.lower(),)
    if model and params:
        raise OptionError("give <model> or <params>, not both")
    workload = Workload(context=context, batch=batch, kv_dtype=check_kv_dtype(kv_dtype), tp=tp)
    budget = Budget(memory, gpu_spec, bandwidth)
    plan_model = resolve_model(model) if model else from_params(parse_params(params)) if params else None
    if plan_model is not None:
        if not tp_allowed(plan_model, tp):
            raise OptionError(f"<tp> {tp} does not divide {plan_model.name}'s {plan_model.arch.num_heads} heads "
                              f"/ {plan_model.arch.num_kv_heads} KV heads")  # fmt: skip
        result = recommend_for_model(plan_model, workload, budget, use_cases)
    else:
        result = recommend_over_presets(workload, budget, use_cases)
    out = {**_to_json(result, workload, budget, plan_model), "rows": result["candidates"]}
    auto = result.get("automatic")
    if auto is not None and model is not None:
        preset = find_preset(model)
        source = preset.source if preset is not None else model  # a preset is converted from its hub id
        auto["command"] = (f"llmopt convert {source} --to gguf --target-size {auto['target_size_bytes']} "
                           f"--calib CALIB.txt -o {plan_model.name}-auto.gguf")  # fmt: skip
    out["automatic"] = auto
    return out


def _to_json(result: dict[str, Any], workload: Workload, budget: Budget, model: PlanModel | None) -> dict[str, Any]:
    notes = ["decode tokens/s and prefill seconds are rooflines (bandwidth and compute upper bounds), not predictions",
             "memory is per device: weights (split over --tp devices) + KV cache + activations + logits + device context"]
    if model is not None and workload.context > model.arch.max_position_embeddings:
        notes.append(f"--context {workload.context} exceeds {model.name}'s trained context of "
                     f"{model.arch.max_position_embeddings} tokens")
    if budget.device(1) is None:
        notes.append("no --gpu or --bandwidth: speed columns are empty")
    return {
        "mode": result["mode"],
        "budget": {"memory_bytes_per_device": budget.memory_bytes, "memory_gib_per_device": round(budget.memory_bytes / GIB, 3),
                   "gpu": budget.gpu.name if budget.gpu else None,
                   "bandwidth_gbs_per_device": budget.bandwidth_gbs or (budget.gpu.bandwidth_gbs if budget.gpu else None),
                   "devices": workload.tp},
        "workload": {"context": workload.context, "batch": workload.batch, "kv_dtype": workload.kv_dtype},
        "models": result["models"],
        "candidates": [r.to_dict() for r in result["candidates"]],
        "recommendations": result["recommendations"],
        "nearest": result["nearest"],
        "notes": notes,
    }  # fmt: skip
