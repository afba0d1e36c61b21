"""Running a plan: shared steps once, then each output (built, scored, gated, recorded), resumable.

An output is finished when its record (`<out>/.llmopt-run/<name>.json`) holds its fingerprint and
the sha256 of what is on disk; a rerun skips it then. Every file appears whole under its final
name (written under a temporary name and renamed), and the record is written last, so a run
killed at any moment is finished by the next one with the same bytes. One run at a time may use an
output folder (a lock); stale temporary files of killed runs there are removed.
"""

from __future__ import annotations

import fcntl
import json
import os
import resource
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from llmopt.api.convert import convert_to_gguf, convert_to_hf
from llmopt.api.evaluate import evaluate, streams
from llmopt.options import EvalOptions
from llmopt.api.imatrix import imatrix as compute_imatrix
from llmopt.api.quantize import quantize
from llmopt.errors import InputError, LlmoptError
from llmopt.formats.atomic import remove_orphans
from llmopt.api.recipe.fingerprint import canonical_sha256
from llmopt.api.recipe.manifest import FORMAT, append_step_summary, model_card, summary_markdown, versions, write_json, write_text
from llmopt.api.recipe.plan import OutputPlan, RunPlan
from llmopt.api.recipe.schema import CheckpointOutput, GgufOutput, HfOutput
from llmopt.runtime.weights import LoadedModel, load_model

Event = Callable[[dict[str, Any]], None]


@dataclass
class RunResult:
    manifest: dict[str, Any]
    manifest_path: Path
    failed: list[str] = field(default_factory=list)  # outputs whose gates failed
    errors: list[str] = field(default_factory=list)  # outputs that could not be made (bad input)


def dry_run(plan: RunPlan) -> dict[str, Any]:
    """The plan as data: shared steps (cached or to do), and per output its target, size and state."""
    steps = []
    if plan.working_copy is not None:
        steps.append({"step": "working copy", "path": str(plan.working_copy), "cached": plan.working_copy.is_dir(),
                      "used_by": [o.name for o in plan.outputs]})  # fmt: skip
    if plan.imatrix is not None:
        steps.append({"step": "imatrix", "path": str(plan.imatrix), "cached": plan.imatrix.is_file(),
                      "used_by": [o.name for o in plan.outputs if o.uses_imatrix]})  # fmt: skip
    outputs = [{"name": o.name, "format": o.spec.format, "path": str(o.target), "predicted_bytes": o.predicted_bytes,
                "size_is_limit": isinstance(o.spec, GgufOutput) and (o.spec.target_size is not None or o.spec.target_bpw is not None),
                "state": "up to date" if _finished(plan, o) is not None else "to build"} for o in plan.outputs]  # fmt: skip
    return {"recipe": str(plan.recipe.path), "model": str(plan.source), "output_dir": str(plan.out_dir),
            "cache": str(plan.cache_dir), "steps": steps, "outputs": outputs}  # fmt: skip


def execute(plan: RunPlan, *, force: bool = False, device: str = "auto", on_event: Event | None = None) -> RunResult:
    """Make every planned output that is not already finished; score and gate them; write the manifest."""
    emit = on_event or (lambda e: None)
    plan.out_dir.mkdir(parents=True, exist_ok=True)
    with _lock(plan.state_dir):
        for folder in {plan.out_dir, plan.state_dir} | {o.folder for o in plan.outputs} | {o.target.parent for o in plan.outputs}:
            _clean_stale(folder)
        emit({"event": "start", "recipe": str(plan.recipe.path), "outputs": [o.name for o in plan.outputs],
              "output_dir": str(plan.out_dir)})  # fmt: skip
        manifest = _manifest_head(plan)
        result = RunResult(manifest, plan.out_dir / "manifest.json")
        reference: list[LoadedModel | Path] = []  # loaded at most once, when the first output is scored
        todo = [o for o in plan.outputs if force or _finished(plan, o) is None]
        if todo:
            with _lock(plan.cache_dir, wait=True):  # jobs on one machine may share a cache: one fills it
                _clean_stale(plan.cache_dir)
                _shared_steps(plan, todo, device, emit)
        for o in plan.outputs:
            entry = _run_output(plan, o, force, device, emit, reference)
            manifest["outputs"][o.name] = entry
            if entry["status"] == "failed":
                result.failed.append(o.name)
            elif entry["status"] == "error":
                result.errors.append(o.name)
            manifest["passed"] = not result.failed and not result.errors
            write_json(result.manifest_path, manifest)  # after each output: a killed run leaves a true record
        plan.hashes.save()
        summary = summary_markdown(manifest)
        write_text(plan.out_dir / "summary.md", summary)
        append_step_summary(summary)
        emit({"event": "done", "manifest": str(result.manifest_path), "passed": manifest["passed"],
              "failed": result.failed, "errors": result.errors})  # fmt: skip
    return result


def _manifest_head(plan: RunPlan) -> dict[str, Any]:
    r = plan.recipe
    return {"llmopt_manifest": FORMAT, "model_name": plan.model_name,
            "recipe": {"file": r.path.name, "sha256": canonical_sha256(r.text)},
            "source": {"model": r.recipe.model, "hub_id": plan.hub_id, "sha256": plan.source_sha256,
                       "bytes": plan.source_bytes},
            "versions": versions(), "passed": True, "outputs": {}}  # fmt: skip


# ----------------------------------------------------------------------------------- shared steps
def _shared_steps(plan: RunPlan, todo: list[OutputPlan], device: str, emit: Event) -> None:
    r = plan.recipe.recipe
    if plan.working_copy is not None and not plan.working_copy.is_dir():
        with _step(emit, "working copy", plan.working_copy):
            convert_to_hf(plan.source, plan.working_copy, dtype=r.working_dtype, force=True)
    elif plan.working_copy is not None:
        emit({"event": "step", "step": "working copy", "status": "cached", "path": str(plan.working_copy)})
    if plan.imatrix is not None and any(o.uses_imatrix for o in todo):
        if plan.imatrix.is_file():
            emit({"event": "step", "step": "imatrix", "status": "cached", "path": str(plan.imatrix)})
        else:
            with _step(emit, "imatrix", plan.imatrix):
                compute_imatrix(plan.model_path, plan.calib_data(), plan.imatrix, calib_field=r.calibration.field,
                                chunks=r.imatrix.chunks or r.calibration.nsamples,
                                ctx_size=r.imatrix.ctx_size or r.calibration.seqlen, force=True, device=device)  # fmt: skip


@contextmanager
def _step(emit: Event, name: str, path: Path) -> Iterator[None]:
    emit({"event": "step", "step": name, "status": "running", "path": str(path)})
    start = time.perf_counter()
    yield
    emit({"event": "step", "step": name, "status": "done", "path": str(path), "seconds": round(time.perf_counter() - start, 3)})


# ---------------------------------------------------------------------------------------- outputs
def _run_output(plan: RunPlan, o: OutputPlan, force: bool, device: str, emit: Event,
                reference: list[LoadedModel | Path]) -> dict[str, Any]:  # fmt: skip
    record = None if force else _finished(plan, o)
    eval_key = _eval_fingerprint(plan, o)
    if record is not None and (eval_key is None or record.get("eval_fingerprint") == eval_key):
        emit({"event": "output", "name": o.name, "status": "skipped", "reason": "finished, fingerprint matches"})
        return {**record["entry"], "reused": True}
    start = time.perf_counter()
    emit({"event": "output", "name": o.name, "status": "building" if record is None else "scoring", "path": str(o.target)})
    try:
        if record is None:
            _build(plan, o, device)
            entry = _describe(plan, o)
        else:
            entry = dict(record["entry"])
        entry["build_seconds"] = round(time.perf_counter() - start, 3) if record is None else entry.get("build_seconds")
        if eval_key is not None:
            entry.update(_score(plan, o, device, reference))
        entry["status"] = ("passed" if all(g["passed"] for g in entry["gates"]) else "failed") if entry.get("gates") else "built"
    except LlmoptError as e:
        emit({"event": "output", "name": o.name, "status": "error", "error": str(e)})
        return {"name": o.name, "format": o.spec.format, "status": "error", "error": str(e)}
    except OSError as e:  # a full disk, a file system that refuses: the run stops; finished outputs stay as they are
        emit({"event": "output", "name": o.name, "status": "error", "error": e.strerror or str(e)})
        raise InputError(f"{o.target}: {e.strerror or e} (output {o.name} was not written; the finished outputs "
                         "and the manifest stay)") from None  # fmt: skip
    entry["seconds"] = round(time.perf_counter() - start, 3)
    entry["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    card = model_card({**_manifest_head(plan), "outputs": {o.name: entry}}, o.name, _entry_text(plan, o.name))
    write_text(o.folder / "README.md", card)
    plan.hashes.save()
    write_json(plan.state_dir / f"{o.name}.json", {"fingerprint": o.fingerprint, "eval_fingerprint": eval_key,
                                                   "entry": entry})  # fmt: skip
    emit({"event": "output", "name": o.name, "status": entry["status"], "sha256": entry["sha256"], "bytes": entry["bytes"],
          "seconds": entry["seconds"], "gates": entry.get("gates", [])})  # fmt: skip
    return entry


def _build(plan: RunPlan, o: OutputPlan, device: str) -> None:
    s = o.spec
    if isinstance(s, GgufOutput):
        imatrix = plan.imatrix if s.imatrix is True else plan.recipe.resolve(s.imatrix) if isinstance(s.imatrix, str) else None
        convert_to_gguf(plan.model_path, o.target, force=True, command=f"llmopt run {plan.recipe.path.name} --only {o.name}",
                        name=plan.model_name, imatrix_name=None if imatrix is None else imatrix.name, device=device,
                        options=s.options(plan.calibration_options(), imatrix))  # fmt: skip
    elif isinstance(s, CheckpointOutput):
        quantize(plan.model_path, o.target, s.options(plan.calibration_options()), force=True, device=device)
    else:
        assert isinstance(s, HfOutput)
        convert_to_hf(plan.model_path, o.target, s.options(), force=True)


def _describe(plan: RunPlan, o: OutputPlan) -> dict[str, Any]:
    """The manifest entry of a freshly built output: what it is, its bytes and how it was made."""
    sha, nbytes, files = plan.hashes.tree(o.target, exclude=("README.md",))
    params = _parameters(plan)
    s = o.spec
    entry: dict[str, Any] = {"name": o.name, "format": s.format, "path": str(o.target.relative_to(plan.out_dir)),
                             "sha256": sha, "bytes": nbytes, "files": files,
                             "bits_per_weight": round(8 * nbytes / params, 4) if params else None,
                             "fingerprint": o.fingerprint}  # fmt: skip
    if isinstance(s, GgufOutput):
        entry["type"] = s.type
        entry["method"] = s.method or "llama.cpp rounding"
    elif isinstance(s, CheckpointOutput):
        entry["method"] = s.method_name()
    entry["options"] = s.model_dump(exclude={"gates", "path", "format"})
    entry["calibration"] = plan.calibration() if s.calibrated or o.uses_imatrix else None
    if o.uses_imatrix and plan.imatrix is not None:
        entry["imatrix"] = {"file": plan.imatrix.name, "sha256": plan.hashes.sha256(plan.imatrix)}
    return entry


def _score(plan: RunPlan, o: OutputPlan, device: str, reference: list[LoadedModel | Path]) -> dict[str, Any]:
    ev = plan.recipe.recipe.eval
    assert ev is not None
    if not reference:  # loaded once for every output, unless it would not fit: then each score streams it
        big = streams([o.target], plan.model_path, EvalOptions.of(ctx=ev.ctx, windows=ev.windows, stream=ev.stream), device)
        reference.append(plan.model_path if big else load_model(str(plan.model_path), "auto", device, quantized=False))
    g = o.spec.gates
    _, gates, summary = evaluate(o.target, plan.recipe.resolve(ev.data), ref=reference[0], ctx=ev.ctx, windows=ev.windows, stream=ev.stream,
                                 max_ppl_increase=g.max_ppl_increase, max_kld=g.max_kld,
                                 min_top1=None if g.min_top1 is None else 100 * g.min_top1, device=device)  # fmt: skip
    metrics = {k: summary.get(k) for k in ("perplexity", "ref_perplexity", "ppl_increase_pct", "kl_divergence",
                                           "top1_agreement", "windows", "ctx", "tokens_scored")}  # fmt: skip
    metrics["data"] = ev.data
    return {"metrics": metrics, "gates": [dict(gate.__dict__) for gate in gates]}


def _eval_fingerprint(plan: RunPlan, o: OutputPlan) -> str | None:
    ev = plan.recipe.recipe.eval
    if ev is None:
        return None
    return canonical_sha256([o.fingerprint, ev.model_dump(exclude={"data", "stream"}), plan.hashes.sha256(plan.recipe.resolve(ev.data)),
                             o.spec.gates.model_dump()])  # fmt: skip


def _finished(plan: RunPlan, o: OutputPlan) -> dict[str, Any] | None:
    """The record of `o` if it is finished with this fingerprint and its bytes are still on disk."""
    path = plan.state_dir / f"{o.name}.json"
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("fingerprint") != o.fingerprint or not o.target.exists():
        return None
    try:
        sha, _, _ = plan.hashes.tree(o.target, exclude=("README.md",))
    except OSError:
        return None
    return record if sha == record.get("entry", {}).get("sha256") else None


def _parameters(plan: RunPlan) -> int:
    from llmopt.model import open_model

    with open_model(plan.model_path) as source:
        return source.parameter_count


def _entry_text(plan: RunPlan, name: str) -> str:
    """The recipe's own text for output `name` (for the model card), as the user wrote it."""
    outputs = next((v for k, v in plan.recipe.root.value if k.value == "outputs"), None)
    pair = next(((k, v) for k, v in getattr(outputs, "value", []) if k.value == name), None)
    if pair is None:
        return yaml.safe_dump({name: plan.recipe.recipe.outputs[name]})
    return plan.recipe.text[pair[0].start_mark.index: pair[1].end_mark.index]


# ------------------------------------------------------------------------------ folder ownership
@contextmanager
def _lock(folder: Path, wait: bool = False) -> Iterator[None]:
    """Hold `folder/.lock` (flock: released by the kernel when a killed process dies, so a lock left by
    a dead run is simply taken). The holder writes who it is into the file; a second run names it."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "a+") as f:  # not "w": that would erase the holder's name before asking
        try:
            fcntl.flock(f, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            holder = f.read(200).strip() or "another llmopt run"
            raise InputError(f"{folder.parent}: this output folder is in use by {holder} (lock {f.name})") from None
        f.seek(0)
        f.truncate()
        f.write(f"llmopt run (pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')})")
        f.flush()
        yield


def _clean_stale(folder: Path) -> None:
    """Temporary files and folders that killed runs left in a folder this run writes."""
    if folder.is_dir():
        remove_orphans(folder)
