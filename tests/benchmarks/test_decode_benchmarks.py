"""Bad options to the decode benchmarks (benchmarks/decode_products.py, runtime_quantized.py): one usage
line and a non-zero exit before any model is written or timed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.parametrize(("script", "args", "message"), [
    ("decode_products.py", ["--types", "Q4_0,Q9_9"], "type 'Q9_9' is not one this benchmark times"),
    ("decode_products.py", ["--shapes", "4096x"], "shape '4096x' is not ROWSxCOLS"),
    ("runtime_quantized.py", ["--mixes", "Q4_0,Q4_K_X"], "unknown mix 'Q4_K_X'"),
    ("runtime_quantized.py", ["--seven-b-types", "Q7"], "unknown mix 'Q7'"),
])  # fmt: skip
def test_bad_options_are_one_line_errors(script, args, message):
    run = subprocess.run([sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and message in run.stderr
    assert "Traceback" not in run.stderr and run.stdout == ""
