"""What `llmopt inspect` reports about a model, as plain data (the CLI renders it)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from llmopt.model.source import ModelSource

_BULKY = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores",
          "tokenizer.chat_template")


def summarize(source: ModelSource, with_tensors: bool = False) -> dict[str, Any]:
    params = source.parameter_count
    nbytes = source.file_bytes
    by_type: dict[str, dict[str, int]] = defaultdict(lambda: {"tensors": 0, "parameters": 0, "bytes": 0})
    stored: set[str] = set()  # the file's own tensors: an expert stack or a fused qkv is one, however it is split
    for t in source.tensors.values():
        row = by_type[t.dtype]
        row["tensors"] += t.stored_name not in stored
        row["parameters"] += t.numel
        row["bytes"] += t.nbytes
        stored.add(t.stored_name)
    tok = source.tokenizer()
    out: dict[str, Any] = {
        "path": str(source.path),
        "format": source.kind,
        "architecture": source.arch.to_dict(),
        "parameters": params,
        "tensor_count": len(stored),
        "bytes": nbytes,
        "bits_per_weight": round(nbytes * 8 / params, 4) if params else None,
        "types": dict(sorted(by_type.items(), key=lambda kv: -kv[1]["bytes"])),
        "metadata": _metadata(source.metadata),
        "tokenizer": tok.summary() if tok is not None else None,
        "quantization_config": source.quantization_config,
    }
    if source.set_aside:  # a multimodal checkpoint: what is not its language model
        aside = source.set_aside.values()
        out["not_read"] = {"model": source.arch.extra.get("multimodal"), "tensors": len(aside),
                           "parameters": sum(t.numel for t in aside), "bytes": sum(t.nbytes for t in aside)}
    if with_tensors:
        out["tensors"] = [
            {"name": t.name, "stored_name": t.stored_name, "shape": list(t.shape), "type": t.dtype, "bytes": t.nbytes}
            for t in source.tensors.values()
        ]
    return out


def _metadata(meta: dict[str, Any]) -> dict[str, Any]:
    shown: dict[str, Any] = {}
    for key, value in meta.items():
        if key in _BULKY:
            continue
        if isinstance(value, list) and len(value) > 16:
            value = f"[{len(value)} items]"
        shown[key] = value
    return shown
