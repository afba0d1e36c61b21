"""The command layers stay readable: no function in `api/` or `cli/` over 80 lines or 15 parameters
(a command's options are one typed value, llmopt/options.py, not a list of keywords)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES, MAX_PARAMS = 80, 15


def oversized(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            params = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs)
            lines = node.end_lineno - node.lineno + 1
            if params > MAX_PARAMS or lines > MAX_LINES:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {params} parameters, {lines} lines")
    return found


def test_no_long_functions_in_the_command_layers() -> None:
    files = [p for layer in ("api", "cli") for p in sorted((ROOT / "llmopt" / layer).rglob("*.py"))]
    found = [hit for p in files for hit in oversized(p)]
    assert not found, "\n".join(found)


def test_the_checker_counts(tmp_path: Path) -> None:
    sample = ROOT / "tests" / "_sample_long_function.py"
    try:
        sample.write_text("def f(" + ", ".join(f"a{i}" for i in range(16)) + "):\n    pass\n\n\ndef g():\n" + "    x = 1\n" * 80)
        assert [h.split(" ", 1)[1] for h in oversized(sample)] == ["f: 16 parameters, 2 lines", "g: 0 parameters, 81 lines"]
    finally:
        sample.unlink()
