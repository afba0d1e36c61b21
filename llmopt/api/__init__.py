"""llmopt's Python API: everything the command line does, as functions (docs/api.md).

One module per command, each the path of that command through the library; `llmopt.cli` parses
flags, calls these, and renders their results. They take the same options as keyword arguments
(named as in the error messages: `bits`, `group_size`, `calib`, ...).

    import llmopt.api as llmopt
    llmopt.convert_to_hf("SmolLM2.gguf", "smollm2")
    llmopt.quantize("smollm2", "smollm2-gptq", method="gptq", bits=4, calib="wiki.txt")
    print(llmopt.generate("smollm2-gptq", "The capital of France is", max_tokens=16).text)
    llmopt.run_recipe("release.yaml", only=["q4km"])
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llmopt.api.bench import bench
    from llmopt.api.convert import convert_to_gguf, convert_to_hf, plan_gguf_file
    from llmopt.api.evaluate import evaluate, evaluate_files
    from llmopt.api.generate import generate, generate_batch, load, read_prompts
    from llmopt.api.imatrix import imatrix
    from llmopt.api.inspect import inspect
    from llmopt.api.quantize import QuantizeResult, quantize
    from llmopt.api.recommend import recommend
    from llmopt.api.run import merge_manifests, plan_recipe, run_recipe

# Each name is loaded with its module on first use: `llmopt recommend` imports llmopt.api.recommend
# without torch, which the other commands' modules need. A command's function has its module's name
# (`quantize` in llmopt/api/quantize.py), and importing a submodule sets the package's attribute to
# the module, so the package's attribute lookup itself answers these names with the function.
_WHERE = {"QuantizeResult": "quantize", "bench": "bench", "convert_to_gguf": "convert", "convert_to_hf": "convert", "evaluate": "evaluate",
          "evaluate_files": "evaluate", "generate": "generate", "generate_batch": "generate", "load": "generate",
          "read_prompts": "generate", "imatrix": "imatrix",
          "inspect": "inspect", "plan_gguf_file": "convert", "quantize": "quantize", "recommend": "recommend",
          "merge_manifests": "run", "plan_recipe": "run", "run_recipe": "run"}  # fmt: skip
__all__ = sorted(_WHERE)


class _Api(types.ModuleType):
    def __getattribute__(self, name: str) -> Any:
        if name in _WHERE:
            return getattr(importlib.import_module(f"llmopt.api.{_WHERE[name]}"), name)
        return super().__getattribute__(name)


sys.modules[__name__].__class__ = _Api

