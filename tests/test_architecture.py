"""The layer order stated in docs/architecture.md holds: no module imports a layer above its own,
or beside it (eval, runtime and plan do not import each other)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "llmopt"
BASE_MODULES = {"errors", "device", "memory", "names", "options", "quantized_tensor", "__init__"}  # llmopt/<name>.py: the base layer


def stated_layers() -> list[set[str]]:
    """The "Layer order (top to bottom): a > b, c > ..." line of docs/architecture.md."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    m = re.search(r"^Layer order \(top to bottom\): (.+)$", text, re.MULTILINE)
    assert m, "docs/architecture.md must state the layer order"
    return [{name.strip() for name in rank.split(",")} for rank in m.group(1).split(">")]


def layer_of(module: str) -> str | None:
    """The layer of a module path under llmopt ("llmopt.quant.gptq" -> "quant"), or None for the package itself."""
    parts = module.split(".")
    if parts[0] != "llmopt" or len(parts) < 2:
        return None
    return "base" if parts[1] in BASE_MODULES else parts[1]


def import_statements(relative: Path, tree: ast.AST) -> list[tuple[ast.stmt, str, list[str]]]:
    """(statement, module, names taken from it) of every llmopt import in a parsed file (path
    relative to the repository), relative imports resolved; `import a.b` takes no names."""
    package = list(relative.with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            found.append((node, base, [a.name for a in node.names]))
    return [(node, m, names) for node, m, names in found if m.startswith("llmopt")]


def imports(relative: Path, source: str) -> list[tuple[int, str]]:
    """(line, module) of every llmopt import in a file (path relative to the repository)."""
    return [(node.lineno, m) for node, m, _ in import_statements(relative, ast.parse(source))]


def violations(files: list[tuple[Path, str]], ranks: list[set[str]]) -> list[str]:
    rank = {name: i for i, names in enumerate(ranks) for name in names}
    wrong = []
    for relative, source in files:
        here = layer_of(".".join(relative.with_suffix("").parts))
        if here is None:
            continue
        for line, module in imports(relative, source):
            there = layer_of(module)
            if there is not None and there != here and rank[there] <= rank[here]:
                wrong.append(f"{relative}:{line}: {here} imports {module} ({there})")
    return wrong


def test_no_import_points_up_or_sideways() -> None:
    ranks = stated_layers()
    layers = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    stated = set().union(*ranks)
    assert layers | {"base"} == stated, f"docs/architecture.md lists {sorted(stated)}, the package has {sorted(layers)}"
    files = [(p.relative_to(ROOT), p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))]
    wrong = violations(files, ranks)
    assert not wrong, "imports against the layer order:\n" + "\n".join(wrong)


def test_the_checker_sees_upward_and_sideways_imports() -> None:
    files = [(Path("llmopt/model/x.py"), "from llmopt.quant.gptq import GPTQConfig\n"),
             (Path("llmopt/eval/y.py"), "import llmopt.runtime.generate\n"),
             (Path("llmopt/quant/z.py"), "from ..model import decoder\nfrom llmopt.errors import InputError\n")]
    assert violations(files, stated_layers()) == [
        "llmopt/model/x.py:1: model imports llmopt.quant.gptq (quant)",
        "llmopt/eval/y.py:1: eval imports llmopt.runtime.generate (runtime)",
    ]
