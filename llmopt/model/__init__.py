"""Reading models lazily (HF directories, GGUF files, hub ids), their architectures and tokenizers.

The names below load their modules on first use (PEP 562), so that `llmopt.model.arch` and the
GGUF header reader can be imported without torch (the CLI's start-up, `recommend`, `inspect`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llmopt.model.arch import ArchSpec
    from llmopt.model.open import open_model
    from llmopt.model.source import ModelSource, TensorInfo
    from llmopt.model.tokenizer import TokenizerInfo

_WHERE = {"ArchSpec": "llmopt.model.arch", "open_model": "llmopt.model.open", "ModelSource": "llmopt.model.source",
          "TensorInfo": "llmopt.model.source", "TokenizerInfo": "llmopt.model.tokenizer"}  # fmt: skip
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'llmopt.model' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
