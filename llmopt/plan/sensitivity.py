"""The cost table of an automatic mix, and its cache file beside the output.

A cost table holds, per tensor (or module), the options it may take and the KL divergence each is
predicted to add (`llmopt.plan.fisher`), and the importance vectors measured on the way.
Measuring it is what takes time, so it is written next to the output
(`<output>.sensitivity.safetensors`: one float64 cost vector and one importance vector per
tensor, the option names and the key in the metadata) and reused while the key is the same: the
model's files, the calibration, the tensors, the candidates and the estimator.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from llmopt.formats.atomic import atomic_output_file
from llmopt.model.source import ModelSource
from llmopt.calibration.activations import ActivationStore
from llmopt.plan.fisher import Diagonal, FisherPass, predicted_kld, slab_rows

Rounding = Callable[[str, torch.Tensor, "torch.Tensor | None"], torch.Tensor]  # (option, weight, importance) -> rounded


@dataclass
class Sensitivities:
    """Per name: the options, the predicted KL of each (nats/token), and an importance vector."""

    options: dict[str, list[str]] = field(default_factory=dict)
    cost: dict[str, list[float]] = field(default_factory=dict)
    importance: dict[str, torch.Tensor] = field(default_factory=dict)
    key: dict = field(default_factory=dict)


def measure(source: ModelSource, names: Mapping[str, str], options: Mapping[str, Sequence[str]], rounded: Rounding,
            samples: torch.Tensor, *, seed: int, key: dict, importance: Mapping[str, torch.Tensor] | None = None,
            device: torch.device | str = "cpu",
            on_step: Callable[[str, int, int], None] | None = None) -> Sensitivities:  # fmt: skip
    """The cost table of `names` (table name -> HF tensor name) over calibration `samples` [n, t]:
    the streamed Fisher pass (`FisherPass`), each tensor rounded (`rounded(option, weight, importance)`)
    to each of its `options` as soon as its diagonal is final. `importance` (table name -> vector)
    replaces the imatrix this pass measures."""
    # a fused tensor (Phi-3's attn_qkv) is its parts' rows: their diagonals stacked, their one input's
    # importance; an expert stack is its experts': diagonals stacked, one importance row per expert
    family = source.arch.family
    parts = {hf: (family.part_names(hf, source.arch) if hf not in source.tensors else None) or [hf] for hf in names.values()}
    owner = {p: name for name, hf in names.items() for p in parts[hf]}
    result = Sensitivities(key=key)
    with ActivationStore() as store:
        fisher = FisherPass(source, samples, list(owner), seed=seed, device=device, store=store,
                            on_step=None if on_step is None else lambda i, n: on_step("fisher", i, n))  # fmt: skip
        seen = fisher.forward()
        for name, hf in names.items():
            found = [seen[p] for p in parts[hf] if p in seen]
            if family.is_stack(hf) and found:  # an expert no calibration token reached: a row of zeros, as llama-imatrix
                result.importance[name] = torch.cat([seen.get(p, torch.zeros_like(found[0])) for p in parts[hf]])
            elif parts[hf][0] in seen:
                result.importance[name] = seen[parts[hf][0]]
        weights = result.importance if importance is None else importance
        waiting: dict[str, dict[str, Diagonal]] = {}
        for diagonal in fisher.diagonals():
            name = owner[diagonal.name]
            got = waiting.setdefault(name, {})
            got[diagonal.name] = diagonal
            if len(got) == len(parts[names[name]]):
                del waiting[name]
                hf = names[name]
                result.cost[name] = tensor_costs(source, hf, [got[p] for p in parts[hf]], options[name], rounded,
                                                 weights.get(name))  # fmt: skip
    result.options = {name: list(options[name]) for name in names}
    result.cost = {name: result.cost[name] for name in names}
    return result


def tensor_costs(source: ModelSource, hf_name: str, diagonals: Sequence[Diagonal], options: Sequence[str],
                 rounded: Rounding, importance: torch.Tensor | None) -> list[float]:  # fmt: skip
    """The predicted KL of `hf_name` rounded to each of `options`. A 2-D tensor is read and rounded a
    slab of rows at a time (every type rounds rows independently, and the costs of rows add), only
    the rows with a diagonal when it is row-sparse; a fused tensor or an expert stack is taken whole,
    as the writer stores it."""
    if len(diagonals) > 1:
        weight = source.load_stored(hf_name, dtype=torch.float32)  # 2-D parts stacked, or [experts, rows, cols]
        diag = torch.cat([d.values.reshape(-1, weight.shape[-1]) for d in diagonals]).reshape(weight.shape)
        costs = [predicted_kld(diag, weight, rounded(o, weight, importance)) for o in options]
        source.release_pages()
        return costs
    d = diagonals[0]
    rows, cols = source.tensors[hf_name].shape
    step = slab_rows(cols)
    costs = [0.0] * len(options)
    for lo in range(0, rows, step):
        hi = min(rows, lo + step)
        values, weight = d.values[lo:hi], None
        if d.rows is not None:
            pick = (d.rows >= lo) & (d.rows < hi)
            if not bool(pick.any()):
                continue
            values, weight = d.values[pick], source.load_rows(hf_name, slice(lo, hi), dtype=torch.float32)[d.rows[pick] - lo]
        if weight is None:
            weight = source.load_rows(hf_name, slice(lo, hi), dtype=torch.float32)
        for k, o in enumerate(options):
            costs[k] += predicted_kld(values, weight, rounded(o, weight, importance))
        source.release_pages()
    return costs


def cache_key(source: ModelSource, calibration: dict, names: Mapping[str, str], candidates: Sequence[str],
              estimator: str, importance_file: str | None = None) -> dict:  # fmt: skip
    """What a cost table depends on: the model's files (names, sizes, times), the calibration, the
    tensors, the candidates, the estimator and an imatrix file."""
    files = [source.path] if source.path.is_file() else sorted(source.path.glob("*"))
    stamp = hashlib.sha256()
    for f in files:
        st = os.stat(f)
        stamp.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    stamp.update(json.dumps(sorted(names.items())).encode())
    return {"estimator": estimator, "candidates": list(candidates), "model": str(source.path),
            "model_files": stamp.hexdigest(), "calibration": calibration, "imatrix": importance_file}  # fmt: skip


def cache_path(output: Path) -> Path:
    """Where the cost table of `output` (a file or a folder) is kept: beside it."""
    return output.with_name(output.name + ".sensitivity.safetensors")


def save(sens: Sensitivities, path: Path) -> None:
    tensors = {f"cost/{n}": torch.tensor(c, dtype=torch.float64) for n, c in sens.cost.items()}
    tensors.update({f"importance/{n}": v.contiguous() for n, v in sens.importance.items()})
    meta = {"key": json.dumps(sens.key, sort_keys=True), "options": json.dumps(sens.options)}
    with atomic_output_file(path) as tmp:
        save_file(tensors, str(tmp), metadata=meta)


def load(path: Path | None, key: dict) -> Sensitivities | None:
    """The cached table at `path` if it was made for `key`, else None (also when unreadable)."""
    if path is None or not path.is_file():
        return None
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        if meta.get("key") != json.dumps(key, sort_keys=True):
            return None
        tensors = load_file(str(path))
        options = json.loads(meta["options"])
        cost = {n: tensors[f"cost/{n}"].tolist() for n in options}
    except (SafetensorError, OSError, ValueError, KeyError):
        return None
    importance = {k.removeprefix("importance/"): v for k, v in tensors.items() if k.startswith("importance/")}
    return Sensitivities(options=options, cost=cost, importance=importance, key=key)
