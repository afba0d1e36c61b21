"""`llmopt quantize --format compressed-tensors` and the commands that read its output; bad input is one line,
exit 2."""

from __future__ import annotations

import json

import pytest

from tests.cli.test_bad_input import assert_clean_failure


@pytest.fixture(scope="module")
def ct_dir(tiny_models, tmp_path_factory, llmopt_cli_module):
    out = tmp_path_factory.mktemp("ct-cli") / "w4"
    result = llmopt_cli_module("quantize", tiny_models("llama"), "--method", "rtn", "--bits", "4", "--group-size", "32",
                               "--format", "compressed-tensors", "-o", out, "--json")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["format"] == "compressed-tensors"
    return out


def test_inspect_and_generate_read_it(ct_dir, llmopt_cli):
    result = llmopt_cli("inspect", ct_dir, "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["format"] == "hf-compressed-tensors"
    result = llmopt_cli("generate", ct_dir, "-p", "hello", "-n", "4", "--temperature", "0")
    assert result.returncode == 0, result.stderr


def test_bits_the_format_cannot_hold(tiny_models, tmp_path, llmopt_cli):
    result = llmopt_cli("quantize", tiny_models("llama"), "--method", "rtn", "--bits", "3", "--format", "compressed-tensors",
                        "-o", tmp_path / "out")  # fmt: skip
    assert_clean_failure(result, "--bits 3: compressed-tensors checkpoints hold 4 or 8 bits")
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_missing_a_scale(ct_dir, tmp_path, llmopt_cli):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    bad.mkdir()
    for f in ct_dir.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    state = load_file(bad / "model.safetensors")
    del state["model.layers.0.self_attn.q_proj.weight_scale"]
    save_file(state, bad / "model.safetensors", metadata={"format": "pt"})
    assert_clean_failure(llmopt_cli("inspect", bad), "model.layers.0.self_attn.q_proj.weight_scale is missing")


def test_nvfp4a16_is_written_and_generates(tiny_models, tmp_path, llmopt_cli):
    out = tmp_path / "nvfp4"
    result = llmopt_cli("quantize", tiny_models("llama"), "--scheme", "nvfp4a16", "-o", out, "--json")
    assert result.returncode == 0, result.stderr
    result = llmopt_cli("inspect", out, "--json")
    assert result.returncode == 0 and "CT-NVFP4" in result.stdout, result.stderr
    result = llmopt_cli("generate", out, "-p", "hello", "-n", "4", "--temperature", "0")
    assert result.returncode == 0, result.stderr


def test_static_activation_schemes_round_to_nearest(tiny_models, tmp_path, llmopt_cli):
    result = llmopt_cli("quantize", tiny_models("llama"), "--scheme", "nvfp4", "--method", "gptq", "-o", tmp_path / "o")
    assert_clean_failure(result, "--scheme nvfp4 rounds to nearest: --method gptq does not apply")
