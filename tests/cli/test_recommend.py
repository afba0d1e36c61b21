"""`llmopt recommend` end to end through the CLI entry point: tables, JSON, and bad input."""

import json

import pytest

from llmopt.cli.app import main
from llmopt.plan.gpus import GPUS
from llmopt.plan.presets import PRESETS


def run(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(["recommend", *args])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def one_line_error(capsys, *args: str) -> str:
    rc, out, err = run(capsys, *args)
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and out == "" and len(lines) == 1, (rc, out, err)
    assert lines[0].startswith("error:") and "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize("mem", ["-1", "abc", "0", "12XB"])
def test_bad_memory(capsys, mem):
    assert "--mem" in one_line_error(capsys, "--mem", mem)


def test_unknown_preset_lists_the_presets(capsys):
    line = one_line_error(capsys, "--mem", "48", "--model", "llama-9-70b")
    assert "llama-9-70b" in line and all(name in line for name in PRESETS)


def test_unknown_gpu_lists_the_catalog(capsys):
    line = one_line_error(capsys, "--mem", "48", "--gpu", "rtx-9090")
    assert "rtx-9090" in line and all(name in line for name in GPUS)


@pytest.mark.parametrize("args, expect", [
    (["--mem", "48", "--use-case", "cheap"], "quality, balanced, speed"),
    (["--mem", "48", "--kv-dtype", "fp8"], "f16, bf16, q8_0, q4_0"),
    (["--mem", "48", "--params", "lots"], "--params"),
    (["--mem", "48", "--context", "0"], "--context"),
    (["--mem", "48", "--model", "llama-3-8b", "--tp", "3"], "--tp 3"),
    (["--mem", "48", "--model", "llama-3-8b", "--params", "8B"], "not both"),
    ([], "--mem"),
])  # fmt: skip
def test_other_bad_input(capsys, args, expect):
    assert expect in one_line_error(capsys, *args)


def test_json_is_only_json_and_has_the_70b_kv_cache(capsys):
    rc, out, err = run(capsys, "--mem", "48", "--model", "llama-3-70b", "--context", "8192", "--gpu", "a100-80g", "--json")
    assert rc == 0
    data = json.loads(out)  # stdout holds nothing else
    assert data["models"][0]["kv_cache_bytes"] == 2 * 80 * 8 * 128 * 8192 * 2
    quality = data["recommendations"]["quality"]
    row = next(r for r in data["candidates"] if r["format"] == quality["format"])
    assert row["fits"] == "yes" and row["weights_bytes"] < 48 * 2**30 and row["headroom_bytes"] > 0
    assert row["decode_tokens_per_s_bound"] > 0 and row["prefill_seconds_bound"] > 0
    assert {"quality", "balanced", "speed"} == set(data["recommendations"])


def test_global_json_flag_works_too(capsys):
    rc = main(["--json", "recommend", "--gpu", "rtx-4090", "--model", "llama-3-8b", "--use-case", "speed"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 0 and set(data["recommendations"]) == {"speed"}
    assert data["budget"]["memory_bytes_per_device"] == 24 * 2**30


def test_table_shows_candidates_picks_and_rooflines(capsys):
    rc, out, _ = run(capsys, "--mem", "48", "--model", "llama-3-70b", "--context", "8192", "--gpu", "rtx-4090")
    assert rc == 0
    for text in ("KV cache: 2,684,354,560 bytes (2.50 GiB)", "Q4_K_M", "AWQ-4bit-g128", "GPTQ-8bit-g128",
                 "quality:", "balanced:", "speed:", "rooflines", "activations"):
        assert text in out, text


def test_nothing_fits_prints_the_nearest_options(capsys):
    rc, out, _ = run(capsys, "--mem", "16", "--params", "70B", "--context", "8192")
    assert rc == 0 and "nothing fits" in out
    assert "shorter context" in out or "smaller model" in out
    assert "tensor parallel" in out


def test_over_all_presets(capsys):
    rc, out, _ = run(capsys, "--mem", "24", "--json")
    data = json.loads(out)
    assert rc == 0 and data["mode"] == "presets" and len(data["models"]) == len(PRESETS)


@pytest.mark.slow
def test_a_real_gguf_file_and_an_hf_directory(capsys, smollm2_gguf, tiny_models):
    rc, out, _ = run(capsys, "--mem", "1", "--model", str(smollm2_gguf), "--json")
    data = json.loads(out)
    assert rc == 0 and data["models"][0]["gguf_metadata_exact"] and data["models"][0]["parameters"] == 134_515_008
    rc, out, _ = run(capsys, "--mem", "1", "--model", str(tiny_models("qwen2")), "--json")
    assert rc == 0 and json.loads(out)["models"][0]["family"] == "qwen2"
