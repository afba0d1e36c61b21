"""`llmopt eval` as a user runs it: the report, --json, gates exiting 1, bad input exiting 2."""

import json

import pytest

from tests.cli.test_bad_input import assert_clean_failure
from tests.factories import CORPUS

WIKITEXT_TEST = "/work/shared/data/wikitext-2/test.txt"


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(CORPUS)
    return path


def test_report_and_json(llmopt_here, tiny_models, text):
    r = llmopt_here("eval", tiny_models("llama"), "--data", text, "--ctx", "32", "--windows", "3", "--ref", tiny_models("mistral"))
    assert r.returncode == 0, r.stderr
    for label in ("perplexity", "ref perplexity", "KL(ref || model)", "top-1 agreement"):
        assert label in r.stdout
    data = json.loads(llmopt_here("eval", tiny_models("llama"), "--data", text, "--ctx", "32", "--windows", "3",
                                 "--ref", tiny_models("mistral"), "--json").stdout)
    assert data["windows"] == 3 and data["tokens_scored"] == 3 * 31 and data["passed"] is True
    assert {"perplexity", "ref_perplexity", "kl_divergence", "top1_agreement", "ppl_increase_pct"} <= data.keys()


def test_gates_pass_against_itself_and_fail_with_exit_1(llmopt_here, llmopt_cli, tiny_models, text):
    model = tiny_models("llama")
    ok = llmopt_here("eval", model, "--data", text, "--ctx", "32", "--windows", "2", "--ref", model,
                    "--max-ppl-increase", "0.01", "--min-top1", "100")
    assert ok.returncode == 0, ok.stderr
    bad = llmopt_cli("eval", model, "--data", text, "--ctx", "32", "--windows", "2", "--ref", tiny_models("qwen2"),
                     "--min-top1", "99.9", "--json")
    assert bad.returncode == 1, bad.stderr
    assert json.loads(bad.stdout)["passed"] is False
    assert "top1_agreement_pct" in bad.stderr and "FAIL" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize("args, expect", [
    (["--min-top1", "90"], "give --ref"),
    (["--windows", "1000"], "fewer than"),
    (["--ctx", "1"], "--ctx"),
])
def test_bad_input_is_one_line_exit_2(llmopt_here, tiny_models, text, args, expect):
    assert_clean_failure(llmopt_here("eval", tiny_models("llama"), "--data", text, *args), expect)


def test_stream_flag(llmopt_here, tiny_models, text):
    """`--stream` runs the models a block at a time and says so (JSON `streamed`, the report's `run` row);
    `--no-stream` loads them; the numbers are the same (tests/eval/test_streamed.py: to rel 1e-5)."""
    args = ["eval", tiny_models("llama"), "--data", text, "--ctx", "32", "--windows", "3", "--ref", tiny_models("mistral")]
    on, off = (json.loads(llmopt_here(*args, flag, "--json").stdout) for flag in ("--stream", "--no-stream"))
    assert on["streamed"] is True and off["streamed"] is False
    assert on["kl_divergence"] == pytest.approx(off["kl_divergence"], rel=1e-5)
    report = llmopt_here(*args, "--stream")
    assert report.returncode == 0 and "streamed, one block at a time" in report.stdout
    assert "streamed" not in llmopt_here(*args, "--no-stream").stdout
    assert_clean_failure(llmopt_here(*args, "--stream", "--keep-quantized"), "--stream runs each block dequantized")


def test_missing_data_file(llmopt_here, tiny_models, tmp_path):
    assert_clean_failure(llmopt_here("eval", tiny_models("llama"), "--data", tmp_path / "none.txt"), "cannot read")


@pytest.mark.slow
def test_smollm2_wikitext_perplexity_equals_transformers(llmopt_cli, smollm2_hf):
    """The project's perplexity definition (non-overlapping windows, tokens 1..ctx-1 scored) on the
    fp16 model, against transformers' float32 forward of the same windows on this machine."""
    import math

    import torch
    import transformers

    ctx, windows = 512, 4
    r = llmopt_cli("eval", smollm2_hf, "--data", WIKITEXT_TEST, "--ctx", str(ctx), "--windows", str(windows),
                   "--threads", "1", "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    ours = json.loads(r.stdout)["perplexity"]
    text = open(WIKITEXT_TEST).read()
    ids = transformers.AutoTokenizer.from_pretrained(smollm2_hf)(text, add_special_tokens=False)["input_ids"]
    x = torch.tensor(ids[: ctx * windows]).view(windows, ctx)
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_hf, dtype=torch.float32).eval()
    nll = 0.0
    with torch.no_grad():
        for window in x:
            logp = torch.log_softmax(model(window[None]).logits[0, :-1].float(), dim=-1)
            nll -= logp.gather(-1, window[1:, None]).sum().item()
    theirs = math.exp(nll / (windows * (ctx - 1)))
    print(f"SmolLM2 fp16 wikitext-2 test perplexity (ctx {ctx}, {windows} windows): llmopt {ours:.5f}, transformers {theirs:.5f}")
    assert abs(ours / theirs - 1) < 1e-4


def test_several_files_one_table_and_the_kld_size_plot(llmopt_here, tiny_models, text, tmp_path):
    """Several GGUF files of one model against it: one table with size and bits/weight, the Pareto
    front marked (the bigger type has lower KL here), and a PNG of KL against size."""
    model = tiny_models("llama")
    files = []
    for mix in ("Q4_0", "Q8_0"):
        out = tmp_path / f"m-{mix}.gguf"
        assert llmopt_here("convert", model, "--to", "gguf", "--type", mix, "-o", out).returncode == 0
        files.append(out)
    plot = tmp_path / "kld.png"
    args = ["eval", *files, "--data", text, "--ctx", "32", "--windows", "3", "--ref", model, "--plot", plot]
    r = llmopt_here(*args)
    assert r.returncode == 0, r.stderr
    for label in ("size", "bpw", "KLD", "front", "m-Q4_0.gguf", "m-Q8_0.gguf"):
        assert label in r.stdout
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = json.loads(llmopt_here(*args[:-2], "--json").stdout)["models"]
    assert [row["bytes"] for row in rows] == [f.stat().st_size for f in files]
    q4, q8 = rows
    assert q8["kl_divergence"] < q4["kl_divergence"] and q4["bits_per_weight"] < q8["bits_per_weight"]
    assert q4["pareto"] and q8["pareto"]
    no_ref = llmopt_here("eval", *files, "--data", text, "--ctx", "32", "--windows", "3", "--plot", plot)
    assert no_ref.returncode == 2 and "--plot draws KL divergence against a reference" in no_ref.stderr
