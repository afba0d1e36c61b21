"""The scale benchmark's harness (benchmarks/scale.py) and the random-model writer it shares with
gptq_memory.py (benchmarks/random_model.py), at the tiny shape only."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from benchmarks.random_model import SPECIAL_TOKENS, word_text, word_tokenizer
from benchmarks.scale import measure

SCALE = Path(__file__).resolve().parents[2] / "benchmarks" / "scale.py"
ROW_FIELDS = {"command", "layers", "calib_tokens", "status", "rc", "wall_s", "peak_rss_gib", "rss_anon_peak_gib",
              "rss_file_peak_gib", "per_block_s", "per_block_from", "proj_70b_s", "flops_ratio_70b", "error", "result",
              "argv", "block_flops", "fraction_of_matmul"}  # fmt: skip


def test_word_tokenizer_is_exactly_as_wide_and_its_text_spans_the_vocabulary(tmp_path):
    ids = word_tokenizer(tmp_path, 2000)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.get_vocab_size(with_added_tokens=True) == 2000
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [1997, 1998, 1999]
    assert ids == {"bos_token_id": 1997, "eos_token_id": 1998}
    text = word_text(tmp_path, 4000, seed=1)
    encoded = tok.encode(text).ids
    assert tok.decode(encoded) == text
    assert len(encoded) == 18 * (4000 // 18)  # one token per word, "." and "\n": the words are whole tokens
    assert {i * 10 // 2000 for i in encoded} == set(range(10))  # every tenth of the id range is hit
    assert len(set(encoded)) > 1000


def test_tiny_shape_runs_commands_and_records_what_it_could_not_run(tmp_path):
    out = tmp_path / "scale.json"
    run = subprocess.run([sys.executable, str(SCALE), "--shape", "tiny", "--commands", "imatrix", "gptq", "eval",
                          "--layers", "2", "--nsamples", "2", "--seqlen", "64", "--windows", "2",
                          "--work", str(tmp_path / "work"), "--json", str(out)],
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["config"]["num_hidden_layers"] == 4 and report["config"]["vocab_size"] == 2000
    rows = {r["command"]: r for r in report["rows"]}
    assert list(rows) == ["imatrix", "gptq", "eval"] and all(set(r) == ROW_FIELDS for r in rows.values())
    for name in ("imatrix", "gptq"):
        r = rows[name]
        assert (r["status"], r["rc"], r["layers"], r["calib_tokens"]) == ("ok", 0, 2, 128), r["error"]
        assert r["wall_s"] > 0 and r["peak_rss_gib"] >= r["rss_anon_peak_gib"] > 0.05
        assert r["flops_ratio_70b"] > 100  # a 70B block against a 256-wide one
        assert r["proj_70b_s"] == pytest.approx(r["per_block_s"] * r["flops_ratio_70b"] * 80, rel=1e-3)
        assert r["fraction_of_matmul"] == pytest.approx(r["block_flops"] / (r["per_block_s"] * report["matmul_gflops"] * 1e9), rel=2e-2)
    assert rows["imatrix"]["result"]["chunks"] == 2 and rows["imatrix"]["per_block_from"] == "wall/layers"
    assert rows["gptq"]["per_block_from"] == "blocks" and len(rows["gptq"]["result"]["blocks"]) >= 2
    assert rows["eval"]["status"] == "skipped" and "no GGUF" in rows["eval"]["error"]  # convert/automix not run
    assert not (tmp_path / "work" / "tiny" / "L2" / "model").exists()  # no --keep: the model is removed
    assert "imatrix" in run.stdout and "skipped" in run.stdout


def test_a_failing_command_is_recorded_with_its_last_stderr_line(tmp_path):
    code = "import sys; print('first', file=sys.stderr); print('error: the last line', file=sys.stderr); sys.exit(3)"
    m = measure([sys.executable, "-c", code], tmp_path / "fail.log", max_rss_gb=None, timeout_s=None)
    assert (m.status, m.rc, m.error) == ("failed", 3, "error: the last line")


def test_memory_of_children_counts_and_the_rss_limit_kills_the_tree(tmp_path):
    child = "import time; x = b'x' * (300 << 20); time.sleep(1.5)"
    parent = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}])"
    m = measure([sys.executable, "-c", parent], tmp_path / "tree.log", max_rss_gb=None, timeout_s=None)
    assert m.status == "ok" and m.rss_anon_peak_kib > 290 << 10 and m.peak_rss_kib > 290 << 10
    m = measure([sys.executable, "-c", parent], tmp_path / "kill.log", max_rss_gb=0.15, timeout_s=None)
    assert m.status == "killed" and m.rc == -9 and m.error.startswith("killed by the harness: RSS")


def test_bad_layers_are_a_one_line_usage_error(tmp_path):
    run = subprocess.run([sys.executable, str(SCALE), "--shape", "tiny", "--layers", "gptqq=2", "--work", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 2 and "unknown command 'gptqq'" in run.stderr and "Traceback" not in run.stderr
    assert not any(tmp_path.iterdir())
