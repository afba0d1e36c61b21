"""How long the command line takes to answer what needs no computation, and its peak memory.

Each command runs as its own process (as a user's shell runs it), five times; the table shows the
median wall time and the largest peak RSS. Target: under 0.5 s for --version, --help and
recommend. Prints a table and a JSON line.
Usage: python benchmarks/cli_startup.py [MODEL.gguf]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time


def measure(args: list[str], runs: int = 5) -> tuple[float, int]:
    times, peak = [], 0
    for _ in range(runs):
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "llmopt.cli.app", *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _, status, rusage = os.wait4(proc.pid, 0)
        times.append(time.perf_counter() - start)
        assert status == 0, args
        peak = max(peak, rusage.ru_maxrss * 1024)
    return statistics.median(times), peak


def main() -> None:
    if len(sys.argv) > 1:
        gguf = sys.argv[1]
    else:
        from llmopt.model.embedded import smollm2_gguf

        gguf = str(smollm2_gguf())
    commands = {"llmopt --version": ["--version"], "llmopt --help": ["--help"], "llmopt recommend --mem 48": ["recommend", "--mem", "48"],
                "llmopt inspect SmolLM2.gguf": ["inspect", gguf]}  # fmt: skip
    rows = {name: measure(args) for name, args in commands.items()}
    print(f"{'command':32} {'wall s':>8} {'peak RSS MB':>12}")
    for name, (seconds, peak) in rows.items():
        print(f"{name:32} {seconds:8.2f} {peak / 1e6:12.0f}")
    print(json.dumps({"benchmark": "cli_startup", "rows": {k: {"seconds": round(s, 3), "peak_rss_bytes": p} for k, (s, p) in rows.items()}}))


if __name__ == "__main__":
    main()
