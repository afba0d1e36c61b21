"""`llmopt generate` as a user runs it: streamed text, the metrics line, --json, bad input."""

import importlib
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


def test_self_speculative_flags_give_plain_tokens_and_report_the_skip_set(llmopt_here, tiny_models, tmp_path):
    prompt = tmp_path / "p.txt"
    prompt.write_text("Pack my box with five dozen liquor jugs. Pack my box with")
    run = ("generate", tiny_models("llama"), "--prompt-file", prompt, "-n", "16", "--ignore-eos", "--json")
    plain = json.loads(llmopt_here(*run).stdout)
    by_hand = json.loads(llmopt_here(*run, "--skip-layers", "1", "--num-draft", "3").stdout)
    assert by_hand["tokens"] == plain["tokens"]
    assert by_hand["metrics"]["skip_layers"] == [1] and by_hand["metrics"]["drafted_tokens"] > 0
    r = llmopt_here(*run, "--self-speculative")
    assert r.returncode == 0, r.stderr
    searched = json.loads(r.stdout)
    assert searched["tokens"] == plain["tokens"]
    assert searched["metrics"]["skip_search_s"] > 0 and isinstance(searched["metrics"]["skip_layers"], list)
    line = llmopt_here("generate", tiny_models("llama"), "-p", "Pack my box", "-n", "4", "--skip-layers", "0")
    assert "skipped layers 0" in line.stderr


@pytest.mark.slow
def test_chat_template_from_gguf_metadata(llmopt_here, smollm2_gguf):
    r = llmopt_here("generate", smollm2_gguf, "--chat", "-p", "What is 2+2?", "-n", "8", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["metrics"]["prompt_tokens"] > 20  # the template's system and role markup were added


def test_keep_quantized_and_compile_ask_for_quantized_weights(llmopt_here, tiny_models, monkeypatch):
    """What `generate` asks the loader for: the size rule by default (None), quantized weights with
    --keep-quantized or --compile, and nothing quantized with --dequantize (--compile too)."""
    from llmopt.errors import InputError

    api = importlib.import_module("llmopt.api.generate")
    asked = []

    def loaded(*args, **kwargs):
        asked.append(args[3])
        raise InputError("loaded")

    monkeypatch.setattr(api, "load_model", loaded)
    for flags in ([], ["--keep-quantized"], ["--compile"], ["--dequantize"], ["--compile", "--dequantize"]):
        assert_clean_failure(llmopt_here("generate", tiny_models("llama"), "-p", "x", *flags), "loaded")
    assert asked == [None, True, True, False, False]


@pytest.mark.slow
def test_keep_quantized_holds_smollm2_quantized_with_the_same_tokens(llmopt_here, smollm2_gguf, monkeypatch):
    """SmolLM2 fits dequantized, so by default it is; --keep-quantized (and --compile, whose step pays only
    on quantized weights) keeps the file's types in memory, and greedy decoding gives the same tokens."""
    api = importlib.import_module("llmopt.api.generate")  # (the package's `generate` is the function)
    asked, real = [], api.load_model
    monkeypatch.setattr(api, "load_model", lambda *a, **k: asked.append(a[3]) or real(*a, **k))
    runs = [llmopt_here("generate", smollm2_gguf, "-p", "The capital of France is", "-n", "24", "--json", *flags)
            for flags in ([], ["--keep-quantized"])]
    assert all(r.returncode == 0 for r in runs), runs[-1].stderr
    assert asked == [None, True]
    plain, kept = (json.loads(r.stdout) for r in runs)
    assert kept["tokens"] == plain["tokens"]


@pytest.mark.parametrize("args, expect", [
    (["-p", "x", "--prompt-file", "f.txt"], "exactly one of"),
    ([], "exactly one of"),
    (["-p", "x", "--draft", "d", "--prompt-lookup", "2"], "one of --draft and --prompt-lookup"),
    (["-p", "x", "--self-speculative", "--draft", "d"], "--self-speculative drafts with the model itself"),
    (["-p", "x", "--skip-layers", "1", "--prompt-lookup", "2"], "does not combine with --draft or --prompt-lookup"),
    (["-p", "x", "--skip-layers", "1,b"], "--skip-layers '1,b': expected layer numbers"),
    (["-p", "x", "--skip-layers", ","], "--skip-layers is empty"),
    (["-p", "x", "--skip-layers", "2"], "--skip-layers 2: this model's layers are 0 to 1"),
    (["-p", "x", "--skip-layers", "0,1"], "skips all 2 layers"),
    (["-p", "x", "--self-speculative"], "--self-speculative's search needs at least 2 (or give --skip-layers)"),
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


def write_jsonl(path, rows):
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def test_prompts_file_answers_in_input_order_like_one_at_a_time(llmopt_here, tiny_models, tmp_path):
    rows = [{"prompt": "The quick brown", "max_tokens": 9, "id": "a"},
            {"prompt": "Pack my box with five dozen", "max_tokens": 5},
            {"prompt": "How vexingly", "max_tokens": 12, "temperature": 0.9, "seed": 4, "id": 7},
            {"prompt": "In the beginning the universe was", "max_tokens": 7}]
    answers = tmp_path / "answers.jsonl"
    r = llmopt_here("generate", tiny_models("llama"), "--prompts", write_jsonl(tmp_path / "p.jsonl", rows),
                    "--max-batch", "3", "--ignore-eos", "--block-size", "4", "--prefill-chunk", "8", "-o", answers)
    assert r.returncode == 0, r.stderr
    assert "4 requests" in r.stderr and r.stdout == ""
    got = [json.loads(line) for line in answers.read_text().splitlines()]
    assert [g["index"] for g in got] == [0, 1, 2, 3] and got[0]["id"] == "a" and got[2]["id"] == 7 and "id" not in got[1]
    for row, answer in zip(rows, got):
        args = ["-p", row["prompt"], "-n", str(row["max_tokens"]), "--ignore-eos", "--json"]
        if "seed" in row:
            args += ["--temperature", str(row["temperature"]), "--seed", str(row["seed"])]
        alone = json.loads(llmopt_here("generate", tiny_models("llama"), *args).stdout)
        assert answer["tokens"] == alone["tokens"] and answer["text"] == alone["text"]
        assert answer["metrics"]["generated_tokens"] == row["max_tokens"]


def test_prompts_to_stdout_with_a_forced_preemption(llmopt_here, tiny_models, tmp_path):
    rows = [{"prompt": "Sphinx of black quartz, judge my vow. " * (1 + i % 3), "max_tokens": 10} for i in range(6)]
    r = llmopt_here("generate", tiny_models("llama"), "--prompts", write_jsonl(tmp_path / "p.jsonl", rows),
                    "--ignore-eos", "--block-size", "4", "--kv-blocks", "20")
    assert r.returncode == 0, r.stderr
    got = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(got) == 6 and all(len(g["tokens"]) == 10 for g in got)
    assert " 0 preemptions" not in r.stderr


@pytest.mark.parametrize("lines, args, expect", [
    (['{"prompt": "hi"}', '{"prompt": "x"'], [], "p.jsonl:2: not a JSON object"),
    (['{"prompt": "hi"}', '', '["hi"]'], [], "p.jsonl:3: expected a JSON object"),
    (['{"text": "hi"}'], [], 'p.jsonl:1: needs "prompt"'),
    (['{"prompt": "hi", "temp": 1}'], [], "p.jsonl:1: unknown key 'temp'"),
    (['{"prompt": "hi", "max_tokens": "5"}'], [], "p.jsonl:1: 'max_tokens' must be int"),
    (['{"prompt": "hi", "temperature": -1}'], [], "p.jsonl:1: `temperature` must be >= 0"),
    (['{"prompt": "hi"}', json.dumps({"prompt": "quick " * 300})], [], "p.jsonl:2: the prompt has"),
    (['{"prompt": "hi"}'], ["--max-batch", "0"], "--max-batch 0: must be at least 1"),
    (['{"prompt": "hi"}'], ["--kv-blocks", "1", "--block-size", "4"], "KV blocks"),
    (['{"prompt": "hi"}'], ["-p", "hi"], "not both"),
    (['{"prompt": "hi"}'], ["--draft", "x"], "--prompt-lookup"),
    (['{"prompt": "hi"}'], ["--self-speculative"], "--self-speculative"),
    (['{"prompt": "hi"}'], ["--skip-layers", "1"], "run one sequence"),
])
def test_bad_prompts_file_is_one_line_exit_2_and_no_answers(llmopt_here, tiny_models, tmp_path, lines, args, expect):
    answers = tmp_path / "answers.jsonl"
    r = llmopt_here("generate", tiny_models("llama"), "--prompts", write_jsonl(tmp_path / "p.jsonl", lines),
                    "-o", answers, *args)
    assert_clean_failure(r, expect)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.jsonl"]  # no answers, no temporary file


@pytest.mark.slow
def test_smollm2_batch_through_the_cli_equals_one_at_a_time(llmopt_here, smollm2_gguf, tmp_path):
    """SmolLM2 end to end: chat prompts sharing a system prompt, batched with the prefix cache,
    give each prompt's own greedy answer."""
    system = "You are a concise assistant. Answer in one short sentence, without lists or preambles."
    questions = ["What is the capital of France?", "Name a primary color.", "What is 2+2?", "What do bees make?"]
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": q, "max_tokens": 12} for q in questions])
    answers = tmp_path / "answers.jsonl"
    r = llmopt_here("generate", smollm2_gguf, "--prompts", prompts, "--chat", "--system", system, "--max-batch", "4",
                    "--prefill-chunk", "64", "-o", answers, "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["requests"] == 4 and summary["cached_tokens"] > 0  # the system prompt was shared
    got = [json.loads(line) for line in answers.read_text().splitlines()]
    for q, answer in zip(questions, got):
        alone = json.loads(llmopt_here("generate", smollm2_gguf, "--chat", "--system", system, "-p", q, "-n", "12",
                                       "--json").stdout)
        assert answer["tokens"] == alone["tokens"] and answer["text"] == alone["text"]
    assert "Paris" in got[0]["text"]
