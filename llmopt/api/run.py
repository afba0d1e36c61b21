"""`run` and `merge_manifests`: a recipe's outputs made, scored and recorded (llmopt.api.recipe)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from llmopt.api.recipe.load import load_recipe
from llmopt.api.recipe.manifest import append_step_summary, merge, summary_markdown, write_json, write_text
from llmopt.api.recipe.plan import plan_run
from llmopt.api.recipe.run import RunResult, dry_run, execute


def run_recipe(recipe: str | Path, *, only: Sequence[str] = (), output_dir: str | Path | None = None,
        cache: str | Path | None = None, force: bool = False, device: str = "auto",
        on_event: Callable[[dict[str, Any]], None] | None = None) -> RunResult:  # fmt: skip
    """Make every output of `recipe` (or those named in `only`) that is not already finished with
    the same fingerprint; score and gate them; write `manifest.json`, `summary.md` and a model card
    per output under `output_dir` (default: the recipe's `output_dir`). Shared steps are kept in
    `cache` (default: `<output_dir>/.cache`). `force` redoes finished outputs."""
    plan = plan_run(load_recipe(recipe), list(only), _path(output_dir), _path(cache))
    return execute(plan, force=force, device=device, on_event=on_event)


def plan_recipe(recipe: str | Path, *, only: Sequence[str] = (), output_dir: str | Path | None = None,
         cache: str | Path | None = None) -> dict[str, Any]:  # fmt: skip
    """What `run_recipe` would do (`--dry-run`): the shared steps, each output's target, predicted size and state."""
    return dry_run(plan_run(load_recipe(recipe), list(only), _path(output_dir), _path(cache)))


def merge_manifests(manifests: Sequence[str | Path], output: str | Path) -> dict[str, Any]:
    """Join the manifests of jobs that each ran part of one recipe (`run --only`) into `output`,
    with its markdown summary beside it (`<output>.md`)."""
    merged = merge([Path(m) for m in manifests])
    out = Path(output)
    write_json(out, merged)
    summary = summary_markdown(merged)
    write_text(out.with_suffix(".md"), summary)
    append_step_summary(summary)
    return merged


def _path(p: str | Path | None) -> Path | None:
    return None if p is None else Path(p)
