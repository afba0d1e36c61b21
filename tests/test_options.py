"""Each option is declared once (llmopt/options.py): the CLI's flag, the Python API's keyword and the
recipe's key all take its default, range and help from that declaration, and no second one exists."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from llmopt.errors import OptionError
from llmopt.options import COMMAND_OPTIONS, GgufOptions, ImatrixOptions, QuantizeOptions

ROOT = Path(__file__).resolve().parent.parent
DECLARED = {d.name for group in COMMAND_OPTIONS for d in group.declared()}


def _cli_params(command: str) -> dict[str, inspect.Parameter]:
    import importlib

    from llmopt.cli.app import COMMANDS

    module, attr = COMMANDS[command]
    return dict(inspect.signature(getattr(importlib.import_module(module), attr)).parameters)


def _recipe_fields():
    from llmopt.api.recipe import schema

    return {QuantizeOptions: schema.CheckpointOutput.model_fields, GgufOptions: schema.GgufOutput.model_fields,
            "calibration": schema.Calibration.model_fields}  # fmt: skip


@pytest.mark.parametrize("group, command", [(QuantizeOptions, "quantize"), (GgufOptions, "convert"),
                                            (ImatrixOptions, "imatrix")])  # fmt: skip
def test_cli_defaults_are_the_declared_ones(group, command) -> None:
    params = _cli_params(command)
    for d in group.declared():
        default = params[d.name].default
        assert (default if default is not None or not isinstance(d.default, tuple) else ()) == d.default, d.name
        info = params[d.name].annotation.__metadata__[0]
        assert info.help.startswith(d.spec.help.split("{")[0]), d.name


@pytest.mark.parametrize("group", [QuantizeOptions, GgufOptions, ImatrixOptions])
def test_api_defaults_are_the_declared_ones(group) -> None:
    built = group.of()
    for d in group.declared():
        assert getattr(built, d.name) == d.default, d.name


def test_recipe_defaults_and_ranges_are_the_declared_ones() -> None:
    from llmopt.api.recipe.schema import CALIBRATION, RUN
    from llmopt.options import CalibrationOptions

    for group, fields in _recipe_fields().items():
        group = CalibrationOptions if group == "calibration" else group
        for d in group.declared():
            key = d.spec.recipe or d.name
            if d.name == "imatrix":  # a recipe's own `imatrix: true | FILE`, not the command's path
                continue
            if d.name == "fmt":  # a recipe output's `format` says which command makes it: always given
                assert fields[key].is_required()
                continue
            if key not in fields:
                assert d.name in CALIBRATION | RUN | {"fmt", "imatrix"} or group is CalibrationOptions, d.name
                continue
            f = fields[key]
            assert (tuple(f.default) if isinstance(f.default, list) else f.default) == d.default, key
            bounds = {type(m).__name__.lower(): getattr(m, type(m).__name__.lower()) for m in f.metadata}
            assert bounds == {k: v for k in ("ge", "gt", "le", "lt") if (v := getattr(d.spec, k)) is not None}, key


def test_the_commands_and_the_methods_read_the_declared_defaults() -> None:
    """The method configs (GPTQConfig, ...) take their defaults from the declarations too."""
    from llmopt.quant.awq import AWQConfig
    from llmopt.quant.gptq import GPTQConfig
    from llmopt.quant.pipeline import QuantizeSpec
    from llmopt.quant.rtn import RTNConfig

    o = QuantizeOptions()
    assert (GPTQConfig().damp, GPTQConfig().bits, GPTQConfig().group_size, GPTQConfig().fp_target) == (o.damp, o.bits, o.group_size, o.gptaq)
    assert (RTNConfig().bits, AWQConfig().group_size, AWQConfig().clip) == (o.bits, o.group_size, o.clip)
    assert QuantizeSpec(RTNConfig()).batch_size == o.batch_size


# Where the method commands' options were declared again before llmopt/options.py held them: their
# commands, API functions, recipe schema, the method rules and the method configs.
SCANNED = [*(f"{layer}/{c}.py" for layer in ("cli", "api") for c in ("quantize", "convert", "imatrix", "generate")),
           "cli/eval.py", "api/evaluate.py", "cli/bench.py", "api/bench/__init__.py", "api/recipe/schema.py", "api/recipe/plan.py",
           "api/recipe/run.py", "quant/spec.py", "quant/gptq.py", "quant/rtn.py", "quant/awq.py", "quant/pipeline.py"]  # fmt: skip
CONFIGS = {"GPTQConfig", "RTNConfig", "AWQConfig", "QuantizeSpec"}
RESULTS = {"BenchRow", "BenchReport"}  # what a command measured, under the names of what it was asked
# What only a recipe has, under an option's name: an output's `imatrix: true` (the shared matrix) or FILE.
# A recipe's gates take '5%' strings and min_top1 as a fraction (eval's flags take percent).
RECIPE_OWN = {"_Gguf.imatrix", "Gates.max_ppl_increase", "Gates.max_kld", "Gates.min_top1"}
# The method configs are read for the method commands' options only (GPTQ's column `block_size` is not the KV cache's).
METHOD_NAMES = {d.name for group in (QuantizeOptions, GgufOptions) for d in group.declared()}
# Options whose declared default is "decide from the others" (None): a config holds the decided value.
DECIDED = {d.name for group in COMMAND_OPTIONS for d in group.declared() if d.default is None}


def _literal_defaults(path: Path) -> list[str]:
    """Parameters and fields named like a declared option that carry a literal default: a second
    declaration of that default."""
    names = METHOD_NAMES if path.parent.name == "quant" else DECLARED
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args.args + node.args.kwonlyargs
            defaults = [None] * (len(node.args.args) - len(node.args.defaults)) + node.args.defaults + node.args.kw_defaults
            for arg, default in zip(args, defaults):
                if arg.arg in names and isinstance(default, ast.Constant) and default.value is not None:
                    found.append(f"{path.name}:{node.lineno} {node.name}({arg.arg}={default.value!r})")
        if isinstance(node, ast.ClassDef):
            for stmt in node.body:
                if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id in names):
                    continue
                name, value = stmt.target.id, stmt.value
                if f"{node.name}.{name}" in RECIPE_OWN:
                    continue
                if isinstance(value, ast.Call) and getattr(value.func, "id", "") == "Field":
                    found.append(f"{path.name}:{stmt.lineno} {node.name}.{name} = Field(...)")
                elif (isinstance(value, ast.Constant) and value.value is not None and node.name not in RESULTS
                      and (node.name not in CONFIGS or name not in DECIDED)):  # fmt: skip
                    found.append(f"{path.name}:{stmt.lineno} {node.name}.{name} = {value.value!r}")
    return found


def test_no_second_declaration() -> None:
    """The commands, the API, the recipe schema and the method configs declare no option again."""
    second = [hit for name in SCANNED for hit in _literal_defaults(ROOT / "llmopt" / name)]
    assert not second, "options declared a second time (take them from llmopt/options.py):\n" + "\n".join(second)


def test_the_checker_sees_a_second_declaration() -> None:
    sample = ROOT / "tests" / "_sample_second_declaration.py"
    try:
        sample.write_text("def f(damp: float = 0.01, bits=None):\n    pass\n\nclass C:\n    nsamples: int = 128\n"
                          "    seqlen: int = Field(512)\n")
        assert [h.split(" ", 1)[1] for h in _literal_defaults(sample)] == ["f(damp=0.01)", "C.nsamples = 128", "C.seqlen = Field(...)"]
    finally:
        sample.unlink()


@pytest.mark.parametrize("values, message", [
    ({"bits": 9}, "<bits> 9: choose 2 to 8"),
    ({"damp": 1.0}, "<damp> 1.0: choose a fraction in [0, 1)"),
    ({"method": "best"}, "<method> 'best': choose one of rtn, gptq, awq, awq+gptq"),
    ({"bits": "4"}, "<bits> '4': expected an integer"),
    ({"act_order": 1}, "<act_order> 1: expected true or false"),
    ({"nsamples": 0}, "<nsamples> 0: expected a value in [1, 1000000]"),
    ({"bogus": 1}, "<bogus>: not an option of quantize"),
])  # fmt: skip
def test_one_check_per_option(values, message) -> None:
    with pytest.raises(OptionError) as e:
        QuantizeOptions.of(**values)
    assert e.value.template.startswith(message), e.value.template
