"""`llmopt generate` as a user runs it: streamed text, the metrics line, --json, bad input."""

import json

import pytest

from tests.cli.test_bad_input import assert_clean_failure


def test_streams_text_then_metrics_line(llmopt_cli, tiny_models):
    r = llmopt_cli("generate", tiny_models("llama"), "--prompt", "The quick brown", "-n", "12", "--ignore-eos")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    metrics = r.stderr.strip().splitlines()[-1]
    for part in ("prompt ", "generated 12 tok", "TTFT", "TPOT", "tok/s"):
        assert part in metrics


def test_json_is_one_object_with_text_and_metrics(llmopt_here, tiny_models):
    r = llmopt_here("generate", tiny_models("llama"), "-p", "The quick brown", "-n", "10", "--ignore-eos",
                   "--temperature", "0.8", "--top-p", "0.9", "--seed", "3", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert len(data["tokens"]) == 10 and isinstance(data["text"], str)
    assert {"prompt_tokens", "generated_tokens", "ttft_ms", "tpot_ms", "tokens_per_s"} <= data["metrics"].keys()
    again = json.loads(llmopt_here("generate", tiny_models("llama"), "-p", "The quick brown", "-n", "10", "--ignore-eos",
                                  "--temperature", "0.8", "--top-p", "0.9", "--seed", "3", "--json").stdout)
    assert again["tokens"] == data["tokens"]  # same seed, same text


def test_speculative_flags_report_acceptance(llmopt_here, tiny_models, tmp_path):
    prompt = tmp_path / "p.txt"
    prompt.write_text("Pack my box with five dozen liquor jugs. Pack my box with")
    plain = json.loads(llmopt_here("generate", tiny_models("llama"), "--prompt-file", prompt, "-n", "16",
                                  "--ignore-eos", "--json").stdout)
    for extra in (["--prompt-lookup", "2"], ["--draft", tiny_models("qwen2"), "--num-draft", "3"]):
        r = llmopt_here("generate", tiny_models("llama"), "--prompt-file", prompt, "-n", "16", "--ignore-eos", "--json", *extra)
        assert r.returncode == 0, r.stderr
        data = json.loads(r.stdout)
        assert data["tokens"] == plain["tokens"]
        assert data["metrics"]["drafted_tokens"] > 0 and 0 <= data["metrics"]["acceptance_rate"] <= 1


@pytest.mark.slow
def test_chat_template_from_gguf_metadata(llmopt_here, smollm2_gguf):
    r = llmopt_here("generate", smollm2_gguf, "--chat", "-p", "What is 2+2?", "-n", "8", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["metrics"]["prompt_tokens"] > 20  # the template's system and role markup were added


@pytest.mark.parametrize("args, expect", [
    (["-p", "x", "--prompt-file", "f.txt"], "exactly one of"),
    ([], "exactly one of"),
    (["-p", "x", "--draft", "d", "--prompt-lookup", "2"], "one of --draft and --prompt-lookup"),
    (["-p", "x", "--temperature", "-1"], "--temperature"),
    (["-p", "x", "--dtype", "int3"], "--dtype"),
    (["-p", "x", "--chat"], "no chat template"),
    (["-p", "x", "--max-tokens", "0"], "--max-tokens"),
    (["-p", "x", "--compile", "--max-tokens", "0"], "--max-tokens"),  # refused before any compiling
])
def test_bad_input_is_one_line_exit_2(llmopt_here, tiny_models, args, expect):
    assert_clean_failure(llmopt_here("generate", tiny_models("llama"), *args), expect)


def test_missing_prompt_file_and_model(llmopt_here, tiny_models, tmp_path):
    assert_clean_failure(llmopt_here("generate", tiny_models("llama"), "--prompt-file", tmp_path / "nope.txt"), "cannot read prompt")
    assert_clean_failure(llmopt_here("generate", tmp_path / "nope", "-p", "x"), "no such file")


def test_max_tokens_is_cut_to_the_context(llmopt_here, tiny_models, caplog):
    """A model with a 256-token context asked for 10^20 tokens generates what its context leaves
    (nothing allocated for the rest), with a warning."""
    result = llmopt_here("generate", tiny_models("llama"), "-p", "hello", "-n", "99999999999999999999", "--ignore-eos", "--json")
    assert result.returncode == 0, result.stderr
    assert "generating at most" in caplog.text
    import json

    data = json.loads(result.stdout)
    assert data["metrics"]["prompt_tokens"] + data["metrics"]["generated_tokens"] == 256  # the tiny model's max_position_embeddings


def test_prompt_longer_than_the_context(llmopt_here, tiny_models):
    result = llmopt_here("generate", tiny_models("llama"), "-p", "hello " * 400, "-n", "4")
    assert result.returncode == 2 and "the model's context is 256" in result.stderr


def test_seed_out_of_range(llmopt_here, tiny_models):
    result = llmopt_here("generate", tiny_models("llama"), "-p", "hi", "--seed", str(2**70))
    assert result.returncode == 2 and "`--seed` " not in result.stderr and "--seed 1180591620717411303424" in result.stderr
