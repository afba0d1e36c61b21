"""The picture users compare quantizations by: KL divergence against file size, and its Pareto front.

A file is on the front when no other file is both no larger and of lower KL divergence. The plot
(matplotlib, `eval --plot`) draws every file, joins the front, and labels each point.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from llmopt.eval.plotting import require_matplotlib


@dataclass(frozen=True)
class Point:
    label: str
    nbytes: int
    kld: float


def pareto_front(points: Sequence[Point]) -> list[int]:
    """Indices of the points on the front, from the smallest file up (KL falling)."""
    order = sorted(range(len(points)), key=lambda i: (points[i].nbytes, points[i].kld, i))
    front: list[int] = []
    for i in order:
        if not front or points[i].kld < points[front[-1]].kld:
            front.append(i)
    return front


def plot_kld_vs_size(points: Sequence[Point], path: Path, title: str) -> None:
    """Write a PNG of KL divergence (log scale) against file size (MB) to `path`."""
    plt = require_matplotlib()
    from llmopt.formats.atomic import atomic_output_file

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    front = pareto_front(points)
    ax.scatter([p.nbytes / 1e6 for p in points], [p.kld for p in points], color="tab:blue", zorder=3)
    ax.plot([points[i].nbytes / 1e6 for i in front], [points[i].kld for i in front], color="tab:orange",
            label="Pareto front", zorder=2)  # fmt: skip
    for p in points:
        ax.annotate(p.label, (p.nbytes / 1e6, p.kld), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_yscale("log")
    ax.set_xlabel("file size (MB)")
    ax.set_ylabel("mean KL divergence from the reference (nats/token)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_output_file(Path(path)) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
