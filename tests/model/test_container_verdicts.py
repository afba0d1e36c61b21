"""The container verdicts of llmopt's readers against the readers no one here wrote: each crafted GGUF
file through llmopt's `read_gguf` and through llama.cpp (ggml's `gguf_init_from_file` plus its model
loader's bounds check, in a child process), each crafted safetensors file through llmopt's
`open_safetensors` and through the safetensors library. Accept/refuse must agree file for file;
llmopt's refusal must be its own one-line InputError, never another exception."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from llmopt.errors import InputError
from llmopt.model.gguf_header import read_gguf
from llmopt.model.hf_dir import open_safetensors
from tests.model import gguf_corpus, safetensors_corpus

ROOT = Path(__file__).resolve().parents[2]


def _write(folder: Path, cases: dict[str, bytes], suffix: str) -> dict[str, Path]:
    folder.mkdir()
    paths = {}
    for i, (name, data) in enumerate(cases.items()):
        paths[name] = folder / f"{i:03d}{suffix}"
        paths[name].write_bytes(data)
    return paths


def _llmopt_verdict(read, path: Path) -> str:
    try:
        read(path)
    except InputError as e:
        assert "\n" not in str(e), str(e)
        return "refused"
    return "ok"


def test_the_corpus_is_large_and_mixed():
    g, s = gguf_corpus.cases(), safetensors_corpus.cases()
    assert len(g) + len(s) >= 100
    assert len(gguf_corpus._valid()) >= 40 and len(g) - len(gguf_corpus._valid()) >= 40


def test_gguf_verdicts_match_llama_cpp(tmp_path):
    paths = _write(tmp_path / "gguf", gguf_corpus.cases(), ".gguf")
    run = subprocess.run([sys.executable, "-m", "tests.model.llama_cpp_verdict", *map(str, paths.values())],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    theirs = dict(zip(paths, run.stdout.split()))
    assert len(theirs) == len(paths)
    ours = {name: _llmopt_verdict(read_gguf, path) for name, path in paths.items()}
    assert {n: (theirs[n], ours[n]) for n in paths if theirs[n] != ours[n]} == {}
    # the corpus means what its names say: the valid half is valid to llama.cpp too
    assert {n for n, v in theirs.items() if v == "ok"} == set(gguf_corpus._valid())


def _library_verdict(path: Path) -> str:
    try:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                f.get_tensor(key)
    except Exception:  # the library's refusals: SafetensorError, and what its Rust side raises
        return "refused"
    return "ok"


def _read_all(path: Path) -> None:
    handle, listed = open_safetensors(path)
    for key, (shape, _) in listed.items():
        assert tuple(handle.get_tensor(key).shape) == shape


def test_safetensors_verdicts_match_the_library(tmp_path):
    paths = _write(tmp_path / "st", safetensors_corpus.cases(), ".safetensors")
    theirs = {name: _library_verdict(path) for name, path in paths.items()}
    ours = {name: _llmopt_verdict(_read_all, path) for name, path in paths.items()}
    assert {n: (theirs[n], ours[n]) for n in paths if theirs[n] != ours[n]} == {}
    assert 10 <= sum(v == "ok" for v in theirs.values()) <= len(paths) - 20


@pytest.mark.parametrize("case", ["two tensors at offset 0 (aliased)", "an overlapping offset"])
def test_aliased_gguf_tensors_are_one_line_for_generate(tmp_path, case):
    """The issue's report: a GGUF whose tensors share bytes ran on aliased weights."""
    path = tmp_path / "bad.gguf"
    path.write_bytes(gguf_corpus.cases()[case])
    with pytest.raises(InputError, match="has data offset .*, expected"):
        read_gguf(path)


def test_zero_dimension_and_empty_gguf_tensors_read(tmp_path):
    path = tmp_path / "ok.gguf"
    path.write_bytes(gguf_corpus.cases()["0 dimensions (a scalar)"])
    (t,) = read_gguf(path).tensors
    assert t.shape == () and t.data.shape == () and t.n_bytes == 4
    path.write_bytes(gguf_corpus.cases()["a zero-element tensor"])
    empty, w = read_gguf(path).tensors
    assert empty.data.shape == (4, 0) and torch.from_numpy(w.data.copy()).shape == (4, 64)
