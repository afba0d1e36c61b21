"""Bad input: a one-line error on stderr, exit code 2, no traceback, and no output left behind."""

import json
import struct
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "wikitext-2"


def assert_clean_failure(result, expect: str, code: int = 2):
    assert result.returncode == code, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error:") and expect in lines[0], lines[0]
    assert "Traceback" not in result.stderr and result.stdout == ""


def convert_leaves_nothing(llmopt_cli, source, tmp_path, expect):
    out = tmp_path / "out"
    result = llmopt_cli("convert", source, "--to", "hf", "-o", out)
    assert_clean_failure(result, expect)
    assert list(tmp_path.glob("*out*")) == []  # neither the output nor a temporary folder


def test_missing_path(llmopt_cli, tmp_path):
    convert_leaves_nothing(llmopt_cli, tmp_path / "nope.gguf", tmp_path, "no such file or directory")


def test_directory_without_config(llmopt_cli, tmp_path):
    (tmp_path / "empty").mkdir()
    convert_leaves_nothing(llmopt_cli, tmp_path / "empty", tmp_path, "no config.json")


def test_truncated_gguf(llmopt_cli, tiny_ggufs, tmp_path):
    data = tiny_ggufs("llama").read_bytes()
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(data[: len(data) // 2])
    convert_leaves_nothing(llmopt_cli, bad, tmp_path, "truncated")


def test_gguf_cut_inside_header(llmopt_cli, tiny_ggufs, tmp_path):
    bad = tmp_path / "short.gguf"
    bad.write_bytes(tiny_ggufs("llama").read_bytes()[:300])
    convert_leaves_nothing(llmopt_cli, bad, tmp_path, "GGUF")


def test_garbage_gguf_header(llmopt_cli, tmp_path):
    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(b"NOPE" + bytes(range(256)) * 4)
    convert_leaves_nothing(llmopt_cli, bad, tmp_path, "not a GGUF file")


def test_safetensors_with_wrong_header_length(llmopt_cli, tiny_models, tmp_path):
    src = tiny_models("llama")
    model = tmp_path / "model"
    model.mkdir()
    for f in src.iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    raw = (model / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(struct.pack("<Q", 10**12) + raw[8:])
    convert_leaves_nothing(llmopt_cli, model, tmp_path, "not a valid safetensors file")


def test_unsupported_architecture(llmopt_cli, tmp_path):
    model = tmp_path / "gpt2"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    result = llmopt_cli("inspect", model)
    assert_clean_failure(result, "unsupported architecture GPT2LMHeadModel; supported:")


def test_unknown_option_is_usage_error(llmopt_cli):
    result = llmopt_cli("inspect", "--no-such-flag", "x")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "No such option" in result.stderr


@pytest.mark.parametrize("args", [["--device", "tpu", "inspect", "x"], ["inspect", "x", "--device", "cuda"]])
def test_bad_device(llmopt_cli, args):
    result = llmopt_cli(*args)
    assert result.returncode == 2
    assert "device" in result.stderr and "Traceback" not in result.stderr


def test_existing_output_needs_force(llmopt_cli, tiny_ggufs, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = llmopt_cli("convert", tiny_ggufs("llama"), "--to", "hf", "-o", out)
    assert_clean_failure(result, "already exists")
    assert (out / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize("make_args, expect", [
    (lambda model, tmp: ["imatrix", model, "--calib", tmp / "nowhere.txt", "-o", tmp / "im.gguf"], "nowhere.txt"),
    (lambda model, tmp: ["imatrix", tmp / "missing-model", "--calib", "self", "-o", tmp / "im.gguf"], "no such file"),
    (lambda model, tmp: ["imatrix", model, "--calib", "self", "--field", "text", "-o", tmp / "im.gguf"], "--calib-field applies"),
])
def test_imatrix_bad_input(llmopt_cli, tiny_models, tmp_path, make_args, expect):
    result = llmopt_cli(*make_args(tiny_models("llama"), tmp_path))
    assert_clean_failure(result, expect)
    assert not (tmp_path / "im.gguf").exists() and not list(tmp_path.glob(".im.gguf*"))


def test_sigterm_mid_quantize_leaves_no_output(tiny_models, tmp_path) -> None:
    """A CI timeout or `kill` stops `quantize` like Ctrl-C: exit 143, its temporary folder removed; only the
    progress of finished blocks stays (for `--resume`), and only once a block has finished."""
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "llmopt.cli.app", "quantize", str(tiny_models("llama")), "--method", "gptq",
           "--group-size", "32", "--calib", str(DATA / "valid.txt"), "--nsamples", "512", "--seqlen", "128", "-o", str(out)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})  # fmt: skip
    deadline = time.monotonic() + 120
    while not any(p.name.startswith(".out.tmp") for p in tmp_path.iterdir()):
        assert proc.poll() is None, f"quantize ended before its temporary folder was seen: {proc.stderr.read()}"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143, stderr
    assert "terminated" in stderr
    left = list(tmp_path.iterdir())
    assert left in ([], [tmp_path / ".out.resume"]), left
    if left:
        assert (tmp_path / ".out.resume" / "inputs.safetensors").is_file()
        assert not [p for p in left[0].iterdir() if ".tmp" in p.name]
