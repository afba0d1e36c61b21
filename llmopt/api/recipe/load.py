"""Reading a recipe: YAML -> `LoadedRecipe`, every error as one line with file:line:column.

PyYAML's node tree keeps where each key and value starts, so an error found by pydantic (a path
of keys) or by the library's own checks (a field name) points back at the text the user wrote.
Relative paths in a recipe are relative to the recipe's folder, as in docker-compose files.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from llmopt.calibration.text import PRESETS, SELF
from llmopt.errors import InputError, OptionError
from llmopt.model.hub import looks_like_hub_id
from llmopt.api.recipe.schema import OUTPUT_KINDS, OUTPUT_NAME, RECIPE_KEYS, GgufOutput, Output, Recipe

class RecipeError(InputError):
    """A recipe that cannot run: one line, `file:line:col: where: what`."""


@dataclass(frozen=True)
class LoadedRecipe:
    path: Path
    text: str
    recipe: Recipe
    outputs: dict[str, Output]
    root: yaml.Node

    @property
    def folder(self) -> Path:
        return self.path.parent

    def resolve(self, value: str) -> Path:
        """A path the recipe names, relative to the recipe's folder."""
        p = Path(value).expanduser()
        return p if p.is_absolute() else (self.folder / p)

    def error(self, keys: Sequence[str | int], message: str, at_key: bool = False) -> RecipeError:
        return _error(self.path, self.root, keys, message, at_key)

    def option_error(self, output: str, e: OptionError) -> RecipeError:
        """A library check's error on `output`, its fields named as the recipe's keys and located."""
        fields = [RECIPE_KEYS.get(f, f) for f in e.fields]
        message = e.render(lambda f: f"`{RECIPE_KEYS.get(f, f)}`")
        spec = self.recipe.outputs[output]
        keys: list[str | int] = ["outputs", output]
        for f in fields:
            if "." in f:
                keys = f.split(".")
                break
            if isinstance(spec, dict) and f in spec:
                keys = ["outputs", output, f]
                break
        return self.error(keys, message)


def load_recipe(path: str | Path) -> LoadedRecipe:
    """Parse and check a recipe file; paths inside are checked to exist (hub ids are not)."""
    path = Path(path).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: cannot read the recipe ({getattr(e, 'strerror', None) or e.__class__.__name__})") from None
    try:
        loader = yaml.SafeLoader(text)
        try:
            root = loader.get_single_node()
            if root is None:
                raise RecipeError(f"{path}:1:1: the recipe is empty; it needs `model` and `outputs`")
            _check_duplicates(path, root)
            data = loader.construct_document(root)
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{mark.line + 1}:{mark.column + 1}" if mark is not None else "1:1"
        raise RecipeError(f"{path}:{where}: not valid YAML: {e.problem or e.context}") from None
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}:1:1: not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise _error(path, root, [], f"a recipe is a mapping with `model` and `outputs`, not a {type(data).__name__}")
    recipe = _validate(path, root, Recipe, data, [])
    outputs = {}
    for name, spec in recipe.outputs.items():
        keys: list[str | int] = ["outputs", name]
        if not OUTPUT_NAME.match(str(name)):
            raise _error(path, root, keys, f"output name {name!r}: use letters, digits, '.', '_' and '-'", at_key=True)
        if not isinstance(spec, dict):
            raise _error(path, root, keys, f"an output is a mapping with `format` and its options, not {spec!r}")
        kind = spec.get("format")
        if kind not in OUTPUT_KINDS:
            where, at_key = (keys + ["format"], False) if "format" in spec else (keys, True)
            raise _error(path, root, where, f"`format` {kind!r}: expected one of {', '.join(OUTPUT_KINDS)}", at_key)
        outputs[str(name)] = _validate(path, root, OUTPUT_KINDS[kind], spec, keys)
    loaded = LoadedRecipe(path, text, recipe, outputs, root)
    _check_paths(loaded)
    return loaded


def _validate(path: Path, root: yaml.Node, model: type[BaseModel], data: dict[str, Any], prefix: list[str | int]) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        first = next((x for x in errors if x["type"] == "extra_forbidden"), errors[0])  # a misspelt key explains a missing one
        loc = [*prefix, *first["loc"]]
        kind = first["type"]
        if kind == "extra_forbidden":
            known = ", ".join(model.model_fields) if not first["loc"][:-1] else None
            hint = f" (expected one of: {known})" if known else ""
            raise _error(path, root, loc, f"unknown key `{loc[-1]}`{hint}", at_key=True) from None
        if kind == "missing":
            raise _error(path, root, loc[:-1], f"missing key `{loc[-1]}`") from None
        message = first["msg"].removeprefix("Value error, ")
        got = first.get("input")
        if kind != "value_error" and not isinstance(got, (dict, list)):
            message += f", got {got!r}"
        raise _error(path, root, loc, f"`{_dotted(loc)}`: {message}") from None


def _check_paths(r: LoadedRecipe) -> None:
    """Files a recipe names exist (the model may be a hub id); imatrix needs text to read."""
    model = r.recipe.model
    if not r.resolve(model).exists() and not looks_like_hub_id(model):
        raise r.error(["model"], f"`model` {model}: no such file or directory (nor a hub id like org/name)")
    data = r.recipe.calibration.data or SELF
    if data != SELF and data not in PRESETS and not r.resolve(data).is_file():
        raise r.error(["calibration", "data"], f"`calibration.data` {data}: no such file (presets: {', '.join(PRESETS)}, or self)")
    if r.recipe.eval is not None and not r.resolve(r.recipe.eval.data).is_file():
        raise r.error(["eval", "data"], f"`eval.data` {r.recipe.eval.data}: no such file")
    for name, out in r.outputs.items():
        if out.gates.any() and r.recipe.eval is None:
            raise r.error(["outputs", name, "gates"], "gates score the output on the recipe's `eval` text: add `eval: {data: FILE}`")
        if isinstance(out, GgufOutput) and isinstance(out.imatrix, str) and not r.resolve(out.imatrix).is_file():
            raise r.error(["outputs", name, "imatrix"], f"`imatrix` {out.imatrix}: no such file")
        if isinstance(out, GgufOutput) and out.imatrix is True and data == SELF:
            raise r.error(["outputs", name, "imatrix"], "`imatrix: true` is computed on `calibration.data`, which must be a "
                                                        "text file or preset (self-written samples feed GPTQ/AWQ only)")  # fmt: skip
        if out.path is not None and (Path(out.path).is_absolute() or ".." in Path(out.path).parts or "/" in out.path):
            raise r.error(["outputs", name, "path"], f"`path` {out.path}: a plain file or folder name inside the output's folder")


def _check_duplicates(path: Path, node: yaml.Node) -> None:
    """YAML allows a key twice (the last wins); in a recipe that hides a mistake, so it is refused."""
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, yaml.Node] = {}
        for key, value in node.value:
            k = key.value if isinstance(key, yaml.ScalarNode) else id(key)
            if k in seen:
                first = seen[k].start_mark
                raise RecipeError(f"{path}:{key.start_mark.line + 1}:{key.start_mark.column + 1}: duplicate key "
                                  f"`{k}` (first at line {first.line + 1})")  # fmt: skip
            seen[k] = key
            _check_duplicates(path, value)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _check_duplicates(path, item)


def _error(path: Path, root: yaml.Node, keys: Sequence[str | int], message: str, at_key: bool = False) -> RecipeError:
    node = _find(root, keys, at_key)
    mark = node.start_mark
    return RecipeError(f"{path}:{mark.line + 1}:{mark.column + 1}: {message}")


def _find(node: yaml.Node, keys: Sequence[str | int], at_key: bool) -> yaml.Node:
    """The node at `keys` (the deepest one that exists); with `at_key`, the last key's own node."""
    for i, k in enumerate(keys):
        if isinstance(node, yaml.MappingNode):
            match = next(((kn, vn) for kn, vn in node.value if isinstance(kn, yaml.ScalarNode) and kn.value == str(k)), None)
            if match is None:
                return node
            node = match[0] if at_key and i == len(keys) - 1 else match[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(k, int) and 0 <= k < len(node.value):
            node = node.value[k]
        else:
            return node
    return node


def _dotted(loc: Sequence[str | int]) -> str:
    return ".".join(str(k) for k in loc if not (isinstance(k, str) and k in ("str", "int", "bool", "list[str]", "dict[str,str]")))
