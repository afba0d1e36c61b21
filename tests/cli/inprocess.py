"""Run `llmopt` inside the test process (no interpreter start-up per call): same entry point, same
exit codes and streams as the subprocess runs, for the many small CLI checks."""

from types import SimpleNamespace

import pytest

from llmopt.cli.app import main


@pytest.fixture
def llmopt_here(capsys):
    def run(*args):
        capsys.readouterr()  # drop what fixtures printed before this call (e.g. building a tiny model)
        code = main([str(a) for a in args])
        captured = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=captured.out, stderr=captured.err)

    return run
