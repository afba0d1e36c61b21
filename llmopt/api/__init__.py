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

from llmopt.api.convert import convert_to_gguf, convert_to_hf, plan_gguf_file
from llmopt.api.evaluate import evaluate, evaluate_files
from llmopt.api.generate import generate, load
from llmopt.api.imatrix import imatrix
from llmopt.api.inspect import inspect
from llmopt.api.quantize import QuantizeResult, quantize
from llmopt.api.recommend import recommend
from llmopt.api.run import merge_manifests, plan_recipe, run_recipe

__all__ = ["QuantizeResult", "convert_to_gguf", "convert_to_hf", "evaluate", "evaluate_files", "generate", "imatrix", "inspect", "load",
           "merge_manifests", "plan_gguf_file", "plan_recipe", "quantize", "recommend", "run_recipe"]
