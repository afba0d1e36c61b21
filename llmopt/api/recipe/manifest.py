"""What a run leaves for people and CI: `manifest.json`, its markdown summary, a model card per output.

The manifest is the record of a run: per output its path, sha256, bytes, bits per weight, options,
calibration, metrics, gates, wall time and peak memory, with the versions that made it. Fanned-out
CI jobs (`--only NAME`) each write one; `merge` joins them when they come from one recipe and source.
"""

from __future__ import annotations

import json
import os
import platform
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import llmopt
from llmopt.errors import InputError
from llmopt.formats.atomic import atomic_output_file
from llmopt.names import CHECKPOINT_FORMATS

FORMAT = 1


def versions() -> dict[str, str]:
    """The versions that decide the bytes: llmopt, torch, gguf, numpy, safetensors, Python."""
    out = {"llmopt": llmopt.__version__, "python": platform.python_version()}
    for dist in ("torch", "gguf", "numpy", "safetensors"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = "absent"
    return out


def write_json(path: Path, data: Any) -> Path:
    """Atomically: a reader sees the old file or the new one, never half of one."""
    with atomic_output_file(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    return path


def write_text(path: Path, text: str) -> Path:
    with atomic_output_file(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return path


def read_manifest(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise InputError(f"{path}: cannot read a manifest ({getattr(e, 'strerror', None) or e.__class__.__name__})") from None
    if not isinstance(data, dict) or data.get("llmopt_manifest") != FORMAT or not isinstance(data.get("outputs"), dict):
        raise InputError(f"{path}: not an llmopt run manifest (format {FORMAT})")
    return data


def merge(paths: list[Path]) -> dict[str, Any]:
    """One manifest from the manifests of jobs that ran parts of one recipe on one source."""
    if not paths:
        raise InputError("give at least one manifest.json to merge")
    merged: dict[str, Any] | None = None
    origin: dict[str, Path] = {}
    for path in paths:
        m = read_manifest(path)
        if merged is None:
            merged = {**m, "outputs": {}}
        for key in ("recipe", "source"):
            if m[key]["sha256"] != merged[key]["sha256"]:
                raise InputError(f"{path}: made from another {key} ({m[key]['sha256'][:12]}) than {paths[0]} "
                                 f"({merged[key]['sha256'][:12]}); merge manifests of one recipe and source")  # fmt: skip
        for name, entry in m["outputs"].items():
            seen = merged["outputs"].get(name)
            if seen is not None and seen.get("sha256") != entry.get("sha256"):
                raise InputError(f"{path}: output {name} differs from the one in {origin[name]} (sha256 "
                                 f"{str(entry.get('sha256'))[:12]} vs {str(seen.get('sha256'))[:12]})")  # fmt: skip
            merged["outputs"][name] = entry
            origin[name] = path
    assert merged is not None
    merged["outputs"] = dict(sorted(merged["outputs"].items()))
    merged["passed"] = all(e["status"] in ("passed", "built") for e in merged["outputs"].values())
    return merged


def summary_markdown(m: dict[str, Any]) -> str:
    """The run as a markdown table, for $GITHUB_STEP_SUMMARY and the folder."""
    lines = [f"### llmopt run: {m['model_name']} ({'passed' if m['passed'] else 'FAILED'})", "",
             "| output | status | file | size | bits/weight | PPL | PPL rise | KLD | top-1 | gates |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for name, e in m["outputs"].items():
        mt = e.get("metrics") or {}
        gates = "; ".join(f"{g['name']} {_num(g['value'])} {'ok' if g['passed'] else '**FAIL**'}" for g in e.get("gates", []))
        lines.append(f"| {name} | {e['status']}{' (reused)' if e.get('reused') else ''} | {e.get('path', '')} | "
                     f"{_mib(e.get('bytes'))} | {_num(e.get('bits_per_weight'))} | {_num(mt.get('perplexity'))} | "
                     f"{_rise(mt.get('ppl_increase_pct'))} | {_num(mt.get('kl_divergence'), 5)} | "
                     f"{_pct(None if mt.get('top1_agreement') is None else 100 * mt['top1_agreement'])} | "
                     f"{gates or e.get('error', '')} |")  # fmt: skip
    v = m["versions"]
    lines += ["", f"source `{m['source']['model']}` sha256 `{m['source']['sha256'][:16]}`; "
                  f"llmopt {v['llmopt']}, torch {v['torch']}, gguf {v['gguf']}", ""]  # fmt: skip
    return "\n".join(lines)


def model_card(m: dict[str, Any], name: str, recipe_entry: str) -> str:
    """README.md beside an output, with the hub's metadata conventions in its YAML front matter."""
    e = m["outputs"][name]
    fmt = e["format"]
    base = m["source"].get("hub_id") or m["model_name"]  # the hub's base_model names a repository
    tags = ["llmopt", "quantized", fmt] + ([e["type"]] if e.get("type") else [])
    front = ["---", f"base_model: {json.dumps(base)}", "quantized_by: llmopt", "tags:"] + [f"- {t}" for t in tags]
    if fmt in (*CHECKPOINT_FORMATS, "hf"):
        front.append("library_name: transformers")
    front.append("---")
    packed = fmt in CHECKPOINT_FORMATS and fmt != "dense"
    opts = e.get("options") or {}
    width = opts.get("scheme") or f"{opts.get('bits')}-bit"  # --scheme fp8-dynamic sets no bits
    what = e.get("type") or (f"{width} {fmt if fmt == 'compressed-tensors' else fmt.upper()}" if packed else fmt)
    body = [f"# {m['model_name']} {what}", "",
            f"Made with llmopt {m['versions']['llmopt']} from `{m['source']['model']}` (sha256 `{m['source']['sha256'][:16]}`).", "",
            "| file | bytes | bits/weight | sha256 |", "|---|---:|---:|---|"]  # fmt: skip
    for f in e.get("files", []):
        body.append(f"| {f['path']} | {f['bytes']} | {_num(e.get('bits_per_weight')) if len(e['files']) == 1 else ''} | `{f['sha256']}` |")
    mt = e.get("metrics")
    if mt:
        body += ["", f"Quality against the source on `{mt['data']}` ({mt['windows']} windows of {mt['ctx']} tokens):", "",
                 "| perplexity | source perplexity | rise | KL divergence | top-1 agreement |", "|---:|---:|---:|---:|---:|",
                 f"| {_num(mt['perplexity'])} | {_num(mt.get('ref_perplexity'))} | {_rise(mt.get('ppl_increase_pct'))} | "
                 f"{_num(mt.get('kl_divergence'), 5)} | {_pct(None if mt.get('top1_agreement') is None else 100 * mt['top1_agreement'])} |"]  # fmt: skip
    if e.get("calibration"):
        c = e["calibration"]
        body += ["", f"Calibration: `{Path(str(c['data'])).name}` (sha256 `{str(c['sha256'])[:16]}`), "
                     f"{c['nsamples']} samples of {c['seqlen']} tokens, seed {c['seed']}."]  # fmt: skip
    body += ["", "Made by this recipe entry:", "", "```yaml", recipe_entry.rstrip(), "```", ""]
    return "\n".join(front + [""] + body)


def append_step_summary(text: str) -> None:
    """Add the summary to GitHub Actions' job page when running there."""
    target = os.environ.get("GITHUB_STEP_SUMMARY")
    if target:
        try:
            with open(target, "a", encoding="utf-8") as f:
                f.write(text + "\n")
        except OSError:
            pass


def _num(v: float | None, digits: int = 3) -> str:
    return "" if v is None else f"{v:.{digits}f}"


def _pct(v: float | None) -> str:
    return "" if v is None else f"{v:.2f}%"


def _rise(v: float | None) -> str:
    return "" if v is None else f"{v:+.2f}%"


def _mib(n: int | None) -> str:
    return "" if n is None else f"{n / 2**20:.1f} MiB"
