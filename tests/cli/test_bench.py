"""`llmopt bench` from the command line: the table, --json, --plot, bad input, and a real server."""

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.cli.test_bad_input import assert_clean_failure


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_table_json_and_plot(llmopt_here, tiny_models, tmp_path):
    model = tiny_models("llama")
    threads = torch.get_num_threads()
    result = llmopt_here("bench", model, "--prompt-len", "8,24", "--gen", "6", "--batch", "1,3", "--threads", "1",
                         "--bandwidth", "10", "--json")  # fmt: skip
    assert result.returncode == 0, result.stderr
    # `--threads 1` is the call's: the in-process runner gives the test process its threads back
    # (they leaked once, and every later test ran on one thread)
    assert torch.get_num_threads() == threads
    report = json.loads(result.stdout)
    assert report["engine"] == "llmopt" and report["bandwidth_gbs"] == 10.0 and report["bandwidth_source"] == "given"
    assert [(r["prompt_len"], r["batch"]) for r in report["rows"]] == [(8, 1), (8, 3), (24, 1), (24, 3)]
    for row in report["rows"]:
        assert row["generated_tokens"] == 6 * row["batch"] and row["ok"] == row["batch"]
        assert row["tpot_ms"]["p50"] <= row["tpot_ms"]["p90"] <= row["tpot_ms"]["p99"]
        assert row["decode_tok_s"] > 0 and 0 < row["roofline_fraction"] and row["peak_memory_bytes"] > 0
    plot = tmp_path / "bench.png"
    result = llmopt_here("bench", model, "--prompt-len", "8", "--gen", "3", "--batch", "1,2", "--plot", plot)
    assert result.returncode == 0, result.stderr
    assert "TTFT" in result.stdout and "measured" in result.stdout  # bandwidth measured when not given
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args,expect", [
    (["--engine", "vllm"], "--engine 'vllm': choose one of llmopt, llama.cpp"),
    (["--batch", "0"], "--batch 0: each value must be between 1"),
    (["--batch", "1,x"], "--batch '1,x': expected integers"),
    (["--prompt-len", "-5"], "--prompt-len -5"),
    (["--prompt-len", "abc"], "--prompt-len 'abc'"),
    (["--gen", "0"], "--gen 0"),
    (["--concurrency", "4"], "--concurrency is for --endpoint"),
    (["--prompt-len", "250", "--gen", "10"], "more than the model's context of 256"),
    (["--bandwidth", "fast"], "--bandwidth 'fast': expected GB/s or a GPU name"),
    (["--engine", "llama.cpp", "--keep-quantized"], "--keep-quantized is for the llmopt engine"),
    (["--engine", "llama.cpp", "--compile"], "--compile is for the llmopt engine"),
    (["--compile", "--batch", "1,4"], "--compile decodes one sequence: leave --batch at 1"),
])
def test_bad_options_are_one_line(llmopt_here, tiny_models, args, expect):
    assert_clean_failure(llmopt_here("bench", tiny_models("llama"), *args), expect)


def test_bad_endpoint_options(llmopt_here, tiny_models):
    model = tiny_models("llama")
    assert_clean_failure(llmopt_here("bench", "--endpoint", "ftp://x/v1", model), "--endpoint 'ftp://x/v1'")
    assert_clean_failure(llmopt_here("bench", model, "--endpoint", "http://127.0.0.1:1/v1", "--batch", "2"),
                         "--batch is for in-process engines")  # fmt: skip
    assert_clean_failure(llmopt_here("bench", model, "--endpoint", "http://127.0.0.1:1/v1", "--engine", "llama.cpp"),
                         "choose one of --engine and --endpoint")  # fmt: skip
    assert_clean_failure(llmopt_here("bench", "--endpoint", "http://127.0.0.1:1/v1", "--model", "m"), "needs the model's tokenizer")
    assert_clean_failure(llmopt_here("bench"), "give the MODEL")
    down = ["bench", model, "--endpoint", "http://127.0.0.1:1/v1"]  # checked before any connection
    assert_clean_failure(llmopt_here(*down, "--requests", "0"), "--requests 0: must be between 1 and")
    assert_clean_failure(llmopt_here(*down, "--time-limit", "0"), "--time-limit 0.0: must be > 0")
    assert_clean_failure(llmopt_here(*down, "--concurrency", "2,0"), "--concurrency 0: each value must be between 1")


def test_server_down_is_one_line(llmopt_cli, tiny_models):
    url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    result = llmopt_cli("bench", tiny_models("llama"), "--endpoint", url, "--requests", "4")
    assert_clean_failure(result, f"{url}: cannot reach the server (connection refused)")


def test_llama_cpp_engine_needs_a_gguf(llmopt_here, tiny_models):
    assert_clean_failure(llmopt_here("bench", tiny_models("llama"), "--engine", "llama.cpp"), "reads a .gguf file")


def test_llama_cpp_engine_without_llama_cpp_python(llmopt_here, tiny_ggufs, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as if the test extra were not installed
    assert_clean_failure(llmopt_here("bench", tiny_ggufs("llama"), "--engine", "llama.cpp"),
                         "--engine llama.cpp needs llama-cpp-python: pip install llama-cpp-python")  # fmt: skip


def test_llama_cpp_engine_json(llmopt_here, tiny_ggufs):
    result = llmopt_here("bench", tiny_ggufs("llama"), "--engine", "llama.cpp", "--prompt-len", "12", "--gen", "5",
                         "--batch", "1,4", "--threads", "1", "--bandwidth", "h100", "--json")  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["engine"] == "llama.cpp" and report["bandwidth_gbs"] == 3350 and "h100" in report["bandwidth_source"]
    assert [(r["batch"], r["generated_tokens"]) for r in report["rows"]] == [(1, 5), (4, 20)]
    assert all(r["decode_tok_s"] > 0 and r["prefill_tok_s"] > 0 for r in report["rows"])


@pytest.fixture(scope="module")
def smollm2_server(smollm2_gguf, tmp_path_factory):
    """llama-cpp-python's OpenAI-compatible server on a free loopback port, serving SmolLM2."""
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"  # a file: llama.cpp's load log would fill a pipe
    # --interrupt_requests False: queue concurrent requests instead of cutting the streaming one short
    proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", str(smollm2_gguf), "--host", "127.0.0.1",
                             "--port", str(port), "--n_ctx", "2048", "--n_threads", "2", "--interrupt_requests", "False"],
                            stdout=subprocess.DEVNULL, stderr=log.open("wb"))  # fmt: skip
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"llama_cpp.server exited: {log.read_text(errors='replace')[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("llama_cpp.server did not start in 120 s")
    yield url
    proc.terminate()
    proc.wait(30)


@pytest.mark.slow
def test_endpoint_bench_against_llama_cpp_server(llmopt_cli, smollm2_server, smollm2_gguf):
    result = llmopt_cli("bench", "--endpoint", smollm2_server, "--model", smollm2_gguf, "--prompt-len", "32",
                        "--gen", "8", "--concurrency", "4", "--requests", "16", "--json")  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["engine"] == "endpoint" and report["model"] == str(smollm2_gguf)
    (row,) = report["rows"]
    assert (row["concurrency"], row["requests"], row["ok"]) == (4, 16, 16)
    assert len(row["records"]) == 16 and 0 < row["generated_tokens"] <= 16 * 8
    for r in row["records"]:
        assert r["ok"] and 0 < r["ttft_s"] <= r["e2e_s"] and 1 <= r["completion_tokens"] <= 8
        assert r["prompt_tokens"] in (None, 32, 33)  # the server may add BOS
    assert row["ttft_ms"]["p50"] <= row["e2e_ms"]["p99"] and row["decode_tok_s"] > 0


@pytest.mark.slow
def test_smollm2_both_engines(llmopt_cli, smollm2_hf_f32, smollm2_f16_gguf):
    runs = {}
    for name, model in (("llmopt", smollm2_hf_f32), ("llama.cpp", smollm2_f16_gguf)):
        result = llmopt_cli("bench", model, "--engine", name, "--prompt-len", "64", "--gen", "8", "--batch", "1,4",
                            "--threads", "2", "--json")  # fmt: skip
        assert result.returncode == 0, result.stderr
        runs[name] = json.loads(result.stdout)
    for report in runs.values():
        assert [r["batch"] for r in report["rows"]] == [1, 4]
        assert all(r["generated_tokens"] == 8 * r["batch"] and r["decode_tok_s"] > 0 for r in report["rows"])
        assert 0 < report["rows"][0]["roofline_fraction"] < 1.5
    # both engines read the same model: fp32 weights, or the F16 GGUF of them (half the bytes)
    assert runs["llama.cpp"]["weight_bytes"] == pytest.approx(runs["llmopt"]["weight_bytes"] / 2, rel=0.01)


@pytest.fixture(scope="module")
def smollm2_f16_gguf(smollm2_hf_f32, tmp_path_factory):
    from llmopt.api.convert import convert_to_gguf

    out = tmp_path_factory.mktemp("f16") / "smollm2-f16.gguf"
    convert_to_gguf(smollm2_hf_f32, out, "F16")
    return Path(out)
