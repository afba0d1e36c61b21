"""The issue's example recipe on the real SmolLM2 (small calibration): outputs that llama.cpp and
llmopt load, a manifest that tells the truth, identical bytes run to run, and kill -9 at three
moments followed by a rerun that finishes with the same bytes."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

DATA = Path(__file__).resolve().parents[4] / "shared" / "data" / "wikitext-2"
RECIPE = """\
model: {model}
calibration: {{data: {data}/valid.txt, nsamples: 8, seqlen: 128, seed: 0}}
eval: {{data: {data}/test.txt, windows: 4, ctx: 128}}
outputs:
  q4km: {{format: gguf, type: Q4_K_M, imatrix: true, gates: {{max_ppl_increase: 5%, max_kld: 0.05}}}}
  q8:   {{format: gguf, type: Q8_0, gates: {{min_top1: 0.97}}}}
  gptq: {{format: gptq, method: gptq, bits: 4, group_size: 128, gates: {{max_ppl_increase: 35%}}}}
"""
# (the event to wait for, seconds to wait after it): inside the shared working copy, inside the
# Q4_K_M file (written, then scored), inside GPTQ's layer loop
KILLS = [(("step", "working copy", "running"), 0.5), (("output", "q4km", "building"), 2.0),
         (("output", "gptq", "building"), 8.0)]  # fmt: skip


def start(recipe: Path, out: Path) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "-m", "llmopt.cli.app", "run", str(recipe), "-o", str(out), "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)  # fmt: skip


def finish(recipe: Path, out: Path) -> list[dict]:
    proc = start(recipe, out)
    stdout, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, stdout
    return [json.loads(line) for line in stdout.splitlines()]


def key(event: dict) -> tuple:
    return event["event"], event.get("step") or event.get("name"), event.get("status")


def final_files(out: Path) -> dict[str, str]:
    """sha256 of every file under a final name (hidden names are temporary files and records)."""
    return {p.relative_to(out).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.rglob("*"))
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(out).parts)}  # fmt: skip


@pytest.fixture(scope="module")
def recipe(smollm2_gguf, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("recipe") / "release.yaml"
    path.write_text(RECIPE.format(model=smollm2_gguf, data=DATA))
    return path


@pytest.fixture(scope="module")
def uninterrupted(recipe) -> Path:
    out = recipe.parent / "out-a"
    finish(recipe, out)
    return out


def test_outputs_manifest_and_loaders(uninterrupted):
    m = json.loads((uninterrupted / "manifest.json").read_text())
    assert m["passed"] and {n: e["status"] for n, e in m["outputs"].items()} == dict.fromkeys(["q4km", "q8", "gptq"], "passed")
    files = final_files(uninterrupted)
    for name, entry in m["outputs"].items():
        for f in entry["files"]:
            rel = entry["path"] if entry["path"].endswith(".gguf") else f"{entry['path']}/{f['path']}"
            assert files[rel] == f["sha256"] and (uninterrupted / rel).stat().st_size == f["bytes"]
    from llama_cpp import Llama  # llama.cpp itself loads and runs both GGUF files

    for name in ("q4km", "q8"):
        llm = Llama(model_path=str(uninterrupted / m["outputs"][name]["path"]), n_ctx=128, verbose=False, seed=0)
        text = llm("The capital of France is", max_tokens=8, temperature=0.0)["choices"][0]["text"]
        assert len(llm.tokenize(text.encode(), add_bos=False)) > 0
        del llm
    import llmopt.api as llmopt

    result = llmopt.generate(uninterrupted / "gptq", "The capital of France is", max_tokens=8)
    assert result.text.strip()


def test_kill_9_then_rerun_gives_the_same_bytes(recipe, uninterrupted):
    expected = final_files(uninterrupted)
    out = recipe.parent / "out-b"
    for trigger, delay in KILLS:
        proc = start(recipe, out)
        assert proc.stdout is not None
        for line in proc.stdout:
            if key(json.loads(line)) == trigger:
                break
        else:
            pytest.fail(f"the run ended before {trigger}")
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        for rel, sha in final_files(out).items():  # no partial file under a final name at any moment
            if rel.endswith("manifest.json"):
                json.loads((out / rel).read_text())
            elif not rel.endswith((".md",)):
                assert sha == expected[rel], f"{rel} differs after kill -9 at {trigger}"
    events = finish(recipe, out)
    assert any(key(e) == ("output", "q4km", "skipped") for e in events)  # finished before the third kill
    after = final_files(out)
    outputs = {rel: sha for rel, sha in expected.items() if not rel.endswith((".md", "manifest.json"))}
    assert {rel: after[rel] for rel in outputs} == outputs  # identical bytes to an uninterrupted run
    leftovers = [p for p in out.rglob(".*") if ".tmp-" in p.name or ".old-" in p.name]
    assert leftovers == []
    again = finish(recipe, out)  # nothing changed: every output skipped
    assert {e["name"]: e["status"] for e in again if e["event"] == "output"} == dict.fromkeys(["q4km", "q8", "gptq"], "skipped")
