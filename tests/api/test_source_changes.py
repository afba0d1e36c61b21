"""A model file replaced, truncated or rewritten while a command reads it: one line (InputError), and
nothing under the output's name, whether the change lands between tensors or between blocks."""

from __future__ import annotations

import os
import shutil

import pytest

from llmopt.api.convert import convert_to_gguf, convert_to_hf
from llmopt.api.quantize import quantize
from llmopt.errors import InputError


@pytest.fixture
def model(tiny_models, tmp_path):
    return shutil.copytree(tiny_models("llama"), tmp_path / "model")


def _append_a_byte(model):
    with open(model / "model.safetensors", "ab") as f:
        f.write(b" ")


def _touch(model):
    st = os.stat(model / "config.json")
    os.utime(model / "config.json", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))


def _left(tmp_path) -> list[str]:
    return sorted(p.name for p in tmp_path.iterdir() if p.name != "model" and not p.name.startswith(".out.resume"))


def test_convert_to_gguf_refuses_a_file_changed_between_tensors(model, tmp_path):
    with pytest.raises(InputError, match="model.safetensors changed while it was being read"):
        convert_to_gguf(model, tmp_path / "out.gguf", "Q8_0", on_tensor=lambda *a: _append_a_byte(model))
    assert _left(tmp_path) == []


def test_quantize_refuses_a_folder_changed_between_blocks(model, tmp_path):
    (tmp_path / "calib.txt").write_text("The quick brown fox jumps over the lazy dog. " * 100)
    with pytest.raises(InputError, match="config.json changed while it was being read"):
        quantize(model, tmp_path / "out", method="gptq", bits=4, group_size=32, calib=str(tmp_path / "calib.txt"),
                        nsamples=4, seqlen=32, on_block=lambda *a: _touch(model))  # fmt: skip
    assert _left(tmp_path) == ["calib.txt"]


def test_convert_to_hf_refuses_a_file_changed_mid_write(model, tmp_path):
    calls = []

    def change(name, nbytes):
        calls.append(name)
        if len(calls) == 2:
            _append_a_byte(model)

    with pytest.raises(InputError, match="changed while it was being read"):
        convert_to_hf(model, tmp_path / "out", dtype="float32", on_tensor=change)
    assert _left(tmp_path) == []


def test_an_unchanged_source_passes(model, tmp_path):
    assert convert_to_gguf(model, tmp_path / "out.gguf", "Q8_0")["bytes"] > 0
