"""Run the real `llmopt` entry point in a subprocess, as a user's shell would."""

import os
import subprocess
import sys

import pytest


@pytest.fixture
def llmopt_cli():
    def run(*args: str, cwd=None) -> subprocess.CompletedProcess:
        env = {**os.environ, "COLUMNS": "200", "HF_HUB_OFFLINE": "1"}
        return subprocess.run([sys.executable, "-m", "llmopt.cli.app", *map(str, args)], capture_output=True,
                              text=True, cwd=cwd, env=env, timeout=600)

    return run
