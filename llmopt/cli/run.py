"""`llmopt run recipe.yaml` (every output of a recipe, gated, resumable) and `llmopt manifest merge`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from llmopt.cli.common import DeviceOpt, JsonOpt, VerboseOpt, emit_json, err, human_bytes, out, settings
from llmopt.errors import CheckFailed, InputError


def run_command(
    ctx: typer.Context,
    recipe: Annotated[Path, typer.Argument(help="The recipe (YAML): model, calibration, eval and outputs.", show_default=False)],
    only: Annotated[Optional[list[str]], typer.Option("--only", help="Make only this output (repeat for more): one CI matrix job per output.", show_default=False)] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan (shared steps, outputs, predicted sizes, what is up to date) and make nothing.")] = False,
    output_dir: Annotated[Optional[Path], typer.Option("-o", "--output-dir", help="Where outputs go (default: the recipe's output_dir, relative to the recipe).", show_default=False)] = None,
    cache: Annotated[Optional[Path], typer.Option("--cache", help="Folder for shared steps (working copy, imatrix); a CI cache. Default: OUTPUT_DIR/.cache.", show_default=False)] = None,
    force: Annotated[bool, typer.Option("--force", help="Redo outputs that are already finished.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="One JSON event per line on stdout (for CI logs), and nothing else there.")] = False,
    device: DeviceOpt = None,
    verbose: VerboseOpt = 0,
) -> None:
    """Make every output of a recipe: shared steps once, then each output built, scored and gated.

    Finished outputs whose fingerprint (source, recipe entry, calibration, llmopt version) matches are skipped, so a rerun after a crash finishes the job. Exit 1 when a gate fails (the other outputs still finish), 2 when the recipe or an output's input is bad. See docs/ci.md.
    """
    from llmopt.api.run import plan_recipe, run_recipe

    opts = settings(ctx, json_out, device, verbose)
    if dry_run:
        p = plan_recipe(recipe, only=only or (), output_dir=output_dir, cache=cache)
        if opts.json:
            print(json.dumps({"event": "plan", **p}))
        else:
            _print_plan(p)
        return
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=err,
                  transient=True, disable=opts.json) as progress:  # fmt: skip
        task = progress.add_task("planning", total=None)

        def on_event(e: dict[str, Any]) -> None:
            if opts.json:
                print(json.dumps(e), flush=True)
                return
            line = _event_line(e)
            if e.get("status") in ("running", "building", "scoring"):
                progress.update(task, description=line)
            elif line:
                out.print(line)

        result = run_recipe(recipe, only=only or (), output_dir=output_dir, cache=cache, force=force, device=opts.device,
                     on_event=on_event)  # fmt: skip
    if not opts.json:
        out.print(f"wrote [bold]{result.manifest_path}[/] and {result.manifest_path.with_name('summary.md').name}")
    if result.errors:
        raise InputError(f"{len(result.errors)} output(s) could not be made: {', '.join(result.errors)} (see the manifest)")
    if result.failed:
        raise CheckFailed(f"gates failed for {', '.join(result.failed)} (the other outputs finished)")


def _event_line(e: dict[str, Any]) -> str:
    kind, status = e["event"], e.get("status")
    if kind == "step":
        if status == "running":
            return f"{e['step']}..."
        took = "cached" if status == "cached" else f"{e['seconds']:.1f}s"
        return f"[green]✓[/] {e['step']} ({took})"
    if kind == "output":
        name = e["name"]
        if status in ("building", "scoring"):
            return f"{name}: {status}..."
        if status == "skipped":
            return f"[green]✓[/] {name}: up to date (skipped)"
        if status == "error":
            return f"[red]✗[/] {name}: {e['error']}"
        gates = "; ".join(f"{g['name']} {g['value']:.4g} {'ok' if g['passed'] else 'FAIL'}" for g in e.get("gates", []))
        mark = "[green]✓[/]" if status != "failed" else "[red]✗[/]"
        return f"{mark} {name}: {status}, {human_bytes(e['bytes'])} in {e['seconds']:.1f}s{'; ' + gates if gates else ''}"
    return ""


def _print_plan(p: dict[str, Any]) -> None:
    out.print(f"[bold]{p['recipe']}[/]: model {p['model']}, outputs in {p['output_dir']}")
    for s in p["steps"]:
        out.print(f"  shared step {s['step']}: {'cached' if s['cached'] else 'to do'} (for {', '.join(s['used_by'])})")
    for o in p["outputs"]:
        size = "" if o["predicted_bytes"] is None else ("at most " if o["size_is_limit"] else "") + human_bytes(o["predicted_bytes"])
        out.print(f"  {o['name']}: {o['format']} -> {o['path']} {size} \\[{o['state']}]")


manifest_app = typer.Typer(help="Manifests of recipe runs.", no_args_is_help=True)


@manifest_app.command("merge")
def merge_command(
    ctx: typer.Context,
    manifests: Annotated[list[Path], typer.Argument(help="manifest.json files of jobs that ran parts of one recipe.", show_default=False)],
    output: Annotated[Path, typer.Option("-o", "--output", help="The merged manifest (its markdown summary goes beside it, .md).")],
    json_out: JsonOpt = False,
    verbose: VerboseOpt = 0,
) -> None:
    """Join the manifests of fanned-out jobs (`run --only NAME`) into one."""
    from llmopt.api.run import merge_manifests

    opts = settings(ctx, json_out, None, verbose)
    merged = merge_manifests(manifests, output)
    if opts.json:
        emit_json(merged)
    else:
        out.print(f"wrote [bold]{output}[/] ({len(merged['outputs'])} outputs, {'passed' if merged['passed'] else 'FAILED'})")
    if not merged["passed"]:
        raise CheckFailed("some outputs failed their gates or could not be made (see the manifest)")
