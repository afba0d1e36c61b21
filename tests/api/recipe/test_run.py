"""`llmopt run` on tiny random models: outputs, manifest, resume, gates, merge, shared steps."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from tests.cli.test_bad_input import assert_clean_failure

RECIPE = """\
model: {model}
calibration: {{data: calib.txt, nsamples: 4, seqlen: 32}}
eval: {{data: calib.txt, windows: 2, ctx: 32}}
outputs:
  q8: {{format: gguf, type: Q8_0, gates: {{min_top1: 0.5, max_kld: 1.0}}}}
  q4: {{format: gguf, type: Q4_0, imatrix: true}}
  rtn: {{format: gptq, method: rtn, bits: 4, group_size: 32, gates: {{max_ppl_increase: 50%}}}}
  f32: {{format: hf, dtype: float32}}
"""


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def events(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.strip()]


@pytest.fixture
def recipe(tmp_path, tiny_models):
    (tmp_path / "calib.txt").write_text("The quick brown fox jumps over the lazy dog. A stitch in time saves nine. " * 30)
    path = tmp_path / "release.yaml"
    path.write_text(RECIPE.format(model=tiny_models("llama")))
    return path


def test_run_writes_outputs_manifest_and_cards(llmopt_here, recipe):
    result = llmopt_here("run", recipe, "--json")
    assert result.returncode == 0, result.stderr
    ev = events(result.stdout)
    assert ev[0]["event"] == "start" and ev[-1] == {**ev[-1], "event": "done", "passed": True}
    assert [e["step"] for e in ev if e["event"] == "step" and e["status"] == "done"] == ["imatrix"]
    out = recipe.parent / "out"
    m = json.loads((out / "manifest.json").read_text())
    assert set(m["outputs"]) == {"q8", "q4", "rtn", "f32"} and m["passed"]
    for name, entry in m["outputs"].items():  # the manifest's hashes and sizes are the files'
        for f in entry["files"]:
            path = out / name / f["path"] if (out / name / f["path"]).exists() else out / entry["path"]
            assert sha256(path) == f["sha256"] and path.stat().st_size == f["bytes"]
        assert (out / name / "README.md").read_text().startswith("---\nbase_model:")
    q8 = m["outputs"]["q8"]
    assert q8["status"] == "passed" and {g["name"] for g in q8["gates"]} == {"top1_agreement_pct", "kl_divergence"}
    assert q8["bytes"] == (out / q8["path"]).stat().st_size and set(m["versions"]) >= {"llmopt", "torch", "gguf"}
    assert m["outputs"]["f32"]["status"] == "built" and m["outputs"]["rtn"]["method"] == "rtn"
    q4 = gguf.GGUFReader(out / m["outputs"]["q4"]["path"])  # llama.cpp's provenance keys, no local paths
    imatrix_file = bytes(q4.fields["quantize.imatrix.file"].parts[-1]).decode()
    assert imatrix_file.startswith("imatrix-") and "/" not in imatrix_file
    assert bytes(q4.fields["general.name"].parts[-1]).decode() == "model"
    assert m["outputs"]["q4"]["imatrix"]["file"] == imatrix_file
    assert "| q8 | passed |" in (out / "summary.md").read_text()


def test_rerun_skips_and_force_gives_same_bytes(llmopt_here, recipe):
    assert llmopt_here("run", recipe).returncode == 0
    out = recipe.parent / "out"
    first = json.loads((out / "manifest.json").read_text())
    again = llmopt_here("run", recipe, "--json")
    assert again.returncode == 0
    assert {e["name"]: e["status"] for e in events(again.stdout) if e["event"] == "output"} == dict.fromkeys(first["outputs"], "skipped")
    assert not any(e["event"] == "step" for e in events(again.stdout))  # no shared step needed
    forced = llmopt_here("run", recipe, "--force", "--json")
    assert forced.returncode == 0
    second = json.loads((out / "manifest.json").read_text())
    assert {n: e["sha256"] for n, e in second["outputs"].items()} == {n: e["sha256"] for n, e in first["outputs"].items()}


def test_changed_entry_rebuilds_only_that_output(llmopt_here, recipe):
    assert llmopt_here("run", recipe).returncode == 0
    recipe.write_text(recipe.read_text().replace("bits: 4, group_size: 32", "bits: 8, group_size: 32"))
    result = llmopt_here("run", recipe, "--json")
    statuses = {e["name"]: e["status"] for e in events(result.stdout) if e["event"] == "output" and e["status"] != "building"}
    assert statuses == {"q8": "skipped", "q4": "skipped", "rtn": "passed", "f32": "skipped"}


def test_changed_gate_rescores_without_rebuilding(llmopt_here, recipe):
    assert llmopt_here("run", recipe).returncode == 0
    before = sha256(next((recipe.parent / "out" / "q8").glob("*.gguf")))
    recipe.write_text(recipe.read_text().replace("min_top1: 0.5", "min_top1: 0.6"))
    result = llmopt_here("run", recipe, "--json")
    assert any(e.get("name") == "q8" and e["status"] == "scoring" for e in events(result.stdout))
    assert sha256(next((recipe.parent / "out" / "q8").glob("*.gguf"))) == before


def test_failed_gate_exits_1_and_the_others_finish(llmopt_cli, recipe):
    recipe.write_text(recipe.read_text().replace("max_ppl_increase: 50%", "max_kld: 0"))
    result = llmopt_cli("run", recipe)
    assert result.returncode == 1
    assert [line for line in result.stderr.splitlines() if line.strip()] == ["error: gates failed for rtn (the other outputs finished)"]
    assert "✗ rtn: failed" in result.stdout
    m = json.loads((recipe.parent / "out" / "manifest.json").read_text())
    assert {n: e["status"] for n, e in m["outputs"].items()} == {"q8": "passed", "q4": "built", "rtn": "failed", "f32": "built"}
    assert not m["passed"] and "| rtn | failed |" in (recipe.parent / "out" / "summary.md").read_text()


def test_only_and_merge(llmopt_here, recipe, tmp_path):
    for name in ("q8", "rtn"):
        assert llmopt_here("run", recipe, "--only", name, "-o", tmp_path / "jobs" / name).returncode == 0
    parts = sorted((tmp_path / "jobs").glob("*/manifest.json"))
    merged = tmp_path / "manifest.json"
    result = llmopt_here("manifest", "merge", *parts, "-o", merged)
    assert result.returncode == 0, result.stderr
    m = json.loads(merged.read_text())
    assert list(m["outputs"]) == ["q8", "rtn"] and m["passed"] and merged.with_suffix(".md").is_file()
    full = llmopt_here("run", recipe, "--only", "q8", "--only", "rtn", "-o", tmp_path / "full")  # same bytes as the jobs
    assert full.returncode == 0
    whole = json.loads((tmp_path / "full" / "manifest.json").read_text())
    assert {n: e["sha256"] for n, e in whole["outputs"].items()} == {n: e["sha256"] for n, e in m["outputs"].items()}


def test_merge_refuses_other_recipes(llmopt_here, recipe, tmp_path):
    assert llmopt_here("run", recipe, "--only", "f32", "-o", tmp_path / "a").returncode == 0
    recipe.write_text(recipe.read_text() + "  extra: {format: hf}\n")
    assert llmopt_here("run", recipe, "--only", "extra", "-o", tmp_path / "b").returncode == 0
    result = llmopt_here("manifest", "merge", tmp_path / "a" / "manifest.json", tmp_path / "b" / "manifest.json", "-o", tmp_path / "m.json")
    assert_clean_failure(result, "made from another recipe")
    assert not (tmp_path / "m.json").exists()
    (tmp_path / "junk.json").write_text("[]")
    assert_clean_failure(llmopt_here("manifest", "merge", tmp_path / "junk.json", "-o", tmp_path / "m.json"), "not an llmopt run manifest")


def test_gguf_source_gets_one_working_copy_and_stale_temps_go(llmopt_here, tiny_ggufs, tmp_path):
    (tmp_path / "calib.txt").write_text("hello world, this is calibration text. " * 40)
    (tmp_path / "r.yaml").write_text(f"model: {tiny_ggufs('llama', 'Q8_0')}\noutputs:\n  a: {{format: gguf, type: Q8_0}}\n"
                                     f"  b: {{format: gptq, method: rtn, group_size: 32}}\n")  # fmt: skip
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / "out" / "a" / f".x.gguf.tmp-{int(gone.stdout)}-abc"  # a killed writer's
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"half a file")
    result = llmopt_here("run", tmp_path / "r.yaml", "--json")
    assert result.returncode == 0, result.stderr
    steps = [e for e in events(result.stdout) if e["event"] == "step"]
    assert [(s["step"], s["status"]) for s in steps] == [("working copy", "running"), ("working copy", "done")]
    assert not stale.exists()
    assert len(list((tmp_path / "out" / ".cache").glob("working-*"))) == 1


def test_bad_output_input_is_an_error_and_others_finish(llmopt_here, recipe):
    """A problem only the build finds (here: a method onto F16, which has no quantized type) fails
    that output with exit 2; the rest are made."""
    recipe.write_text(recipe.read_text().replace("type: Q4_0, imatrix: true", "type: F16, method: gptq"))
    result = llmopt_here("run", recipe)
    assert result.returncode == 2 and "error: 1 output(s) could not be made: q4" in result.stderr
    m = json.loads((recipe.parent / "out" / "manifest.json").read_text())
    assert m["outputs"]["q4"]["status"] == "error" and m["outputs"]["q8"]["status"] == "passed"


def test_a_reference_that_does_not_fit_is_streamed_with_the_same_scores(llmopt_here, recipe, monkeypatch):
    """Where the reference would not fit beside an output, the recipe does not load it: each score
    streams both models one block at a time, with the numbers of the loaded path."""
    from llmopt.runtime import weights

    assert llmopt_here("run", recipe).returncode == 0
    loaded = json.loads((recipe.parent / "out" / "manifest.json").read_text())
    monkeypatch.setattr(weights, "available_memory", lambda: 1)  # nothing fits: every eval streams
    calls = []
    monkeypatch.setattr(weights, "load_model", lambda *a, **k: calls.append(a))
    import llmopt.api.recipe.run as run

    monkeypatch.setattr(run, "load_model", lambda *a, **k: calls.append(a))
    recipe.write_text(recipe.read_text().replace("min_top1: 0.5", "min_top1: 0.55"))  # rescore q8 only
    result = llmopt_here("run", recipe, "--json")
    assert result.returncode == 0, result.stderr
    assert calls == []
    streamed = json.loads((recipe.parent / "out" / "manifest.json").read_text())
    for key, value in loaded["outputs"]["q8"]["metrics"].items():
        want = pytest.approx(value, rel=1e-5, abs=1e-4) if isinstance(value, float) else value  # abs: the % rise
        assert streamed["outputs"]["q8"]["metrics"][key] == want, key


def test_eval_stream_in_the_recipe_streams_and_changes_no_fingerprint(llmopt_here, recipe, monkeypatch):
    """`eval: {stream: true}` streams every score though the reference fits (a benchmark at a few layers
    of a big model wants the full-depth path), and, as it changes no number, finished scores stay."""
    import llmopt.api.recipe.run as run

    assert llmopt_here("run", recipe).returncode == 0
    loaded = json.loads((recipe.parent / "out" / "manifest.json").read_text())
    calls = []
    monkeypatch.setattr(run, "load_model", lambda *a, **k: calls.append(a))
    recipe.write_text(recipe.read_text().replace("ctx: 32}", "ctx: 32, stream: true}"))
    result = llmopt_here("run", recipe, "--json")
    assert result.returncode == 0, result.stderr
    assert {e["name"]: e["status"] for e in events(result.stdout) if e["event"] == "output"} == dict.fromkeys(loaded["outputs"], "skipped")
    recipe.write_text(recipe.read_text().replace("min_top1: 0.5", "min_top1: 0.55"))  # rescore q8 only
    assert llmopt_here("run", recipe, "--json").returncode == 0
    assert calls == []
    streamed = json.loads((recipe.parent / "out" / "manifest.json").read_text())
    for key, value in loaded["outputs"]["q8"]["metrics"].items():
        want = pytest.approx(value, rel=1e-5, abs=1e-4) if isinstance(value, float) else value
        assert streamed["outputs"]["q8"]["metrics"][key] == want, key


def test_a_second_run_on_the_folder_names_the_holder_and_a_dead_ones_lock_is_taken(llmopt_here, recipe):
    from llmopt.api.recipe.run import _lock

    state = recipe.parent / "out" / ".llmopt-run"
    with _lock(state):
        result = llmopt_here("run", recipe, "--only", "q8")
    assert_clean_failure(result, f"{recipe.parent / 'out'}: this output folder is in use by llmopt run (pid {os.getpid()} on ")
    # a run killed with -9 leaves its name in the file but no lock: the next run goes ahead
    (state / ".lock").write_text("llmopt run (pid 999999999 on elsewhere, since 2026-01-01 00:00:00)")
    assert llmopt_here("run", recipe, "--only", "q8").returncode == 0
