"""What every command shares: global options, consoles, JSON output and number formatting."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Annotated, Any, Optional

import typer
from rich.console import Console


# Human output on stdout; progress, logs and errors on stderr (so --json leaves stdout clean).
out = Console(highlight=False)
err = Console(stderr=True, highlight=False)

JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout, and nothing else there.")]
DeviceOpt = Annotated[Optional[str], typer.Option("--device", help="auto | cpu | cuda  [default: auto]", show_default=False)]
VerboseOpt = Annotated[int, typer.Option("-v", "--verbose", count=True, help="More detail on stderr (-vv for debug).")]
ForceOpt = Annotated[bool, typer.Option("--force", help="Replace the output if it exists.")]


@dataclass
class Settings:
    json: bool = False
    device: str = "auto"
    verbose: int = 0


def settings(ctx: typer.Context, json_out: bool = False, device: str | None = None, verbose: int = 0) -> Settings:
    """Merge the options given before the command (`llmopt --json inspect`) with those after it."""
    root: Settings = ctx.find_root().obj or Settings()
    s = Settings(json=root.json or json_out, device=device or root.device, verbose=max(root.verbose, verbose))
    if s.device != "auto":  # validate early: bad names and missing CUDA are usage errors (auto needs no torch yet)
        from llmopt.device import resolve_device

        resolve_device(s.device)
    logging.basicConfig(level=logging.WARNING - 10 * min(s.verbose, 2), format="%(levelname)s %(name)s: %(message)s")
    return s


def emit_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=str))


def human_count(n: int | float) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}" if unit == "B" else f"{n / div:.1f}{unit}"
    return str(n)


def human_bytes(n: int | float) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"
