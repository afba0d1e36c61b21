"""`inspect`: architecture, size, tensor types, tokenizer and metadata of any readable model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmopt.model import open_model
from llmopt.model.summary import summarize


def inspect(model: str | Path, *, tensors: bool = False) -> dict[str, Any]:
    """What `model` (an HF directory, GGUF file or hub id) is, as plain data; `tensors` lists each one."""
    with open_model(model) as source:
        return summarize(source, with_tensors=tensors)
