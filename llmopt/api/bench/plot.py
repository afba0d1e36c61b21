"""`bench --plot`: decode throughput and TTFT against batch size (or concurrency), one line per
prompt length. matplotlib is optional (`pip install 'llmopt[plot]'`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmopt.eval.plotting import require_matplotlib


def plot_report(report: Any, path: Path) -> None:
    """Two panels of `report` (a BenchReport) as a PNG at `path`, written atomically."""
    from llmopt.formats.atomic import atomic_output_file

    plt = require_matplotlib()
    load = "concurrency" if report.engine == "endpoint" else "batch"
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), dpi=120)
    for length in sorted({r.prompt_len for r in report.rows}):
        rows = sorted((r for r in report.rows if r.prompt_len == length), key=lambda r: getattr(r, load))
        x = [getattr(r, load) for r in rows]
        left.plot(x, [r.decode_tok_s or 0 for r in rows], marker="o", label=f"prompt {length}")
        right.plot(x, [r.ttft_ms["p50"] if r.ttft_ms else 0 for r in rows], marker="o", label=f"prompt {length}")
    for ax, label in ((left, "decode tokens/s (all sequences)"), (right, "TTFT p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel(load)
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{report.engine}: {Path(report.model).name}, {report.device}", fontsize=9)
    fig.tight_layout()
    with atomic_output_file(Path(path)) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
