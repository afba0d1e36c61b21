"""The commands that need no model computation start without torch (issue 21: under 0.5 s; the
times are in benchmarks/cli_startup.py), and `--version` imports no command at all."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROBE = """
import contextlib, io, json, sys
from llmopt.cli.app import main
with contextlib.redirect_stdout(io.StringIO()):
    code = main(sys.argv[1:])
print(json.dumps({"code": code, "modules": sorted(sys.modules)}))
"""


def imported(*args: str) -> set[str]:
    done = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=60)
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["code"] in (0, None), done.stderr
    return set(result["modules"])


@pytest.mark.parametrize("args", [["--version"], ["--help"], ["recommend", "--mem", "48"], ["inspect", "{gguf}"]])
def test_no_torch_at_start_up(args, tiny_ggufs):
    modules = imported(*(a.format(gguf=tiny_ggufs("llama")) for a in args))
    assert "torch" not in modules


def test_version_imports_no_command():
    assert not {m for m in imported("--version") if m.startswith("llmopt.cli.") and m not in ("llmopt.cli.app", "llmopt.cli.common", "llmopt.cli.flags")}
