"""The numbers a benchmark row reports: percentiles of latencies, rates, and option lists.

Pure Python (no numpy, no torch): the endpoint client and the CLI's checks use it before any model
is loaded. Percentiles interpolate linearly between the closest ranks, numpy's default method,
so p50 of an even count is the mean of the middle two.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from llmopt.errors import OptionError

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100) of `values`, by linear interpolation between ranks."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside 0..100")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(rank), math.ceil(rank)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def distribution(values: Sequence[float]) -> dict[str, float] | None:
    """p50, p90, p99 and the mean of `values` (None when there are none: a one-token generation has no TPOT)."""
    if not values:
        return None
    summary = {f"p{q}": percentile(values, q) for q in PERCENTILES}
    summary["mean"] = sum(values) / len(values)
    return summary


def int_list(text: str | Sequence[int], field: str, low: int = 1, high: int = 1 << 20) -> list[int]:
    """`"128,512,2048"` -> [128, 512, 2048]: each an integer in [low, high], no repeats kept."""
    parts = text.split(",") if isinstance(text, str) else list(text)
    values: list[int] = []
    for part in parts:
        try:
            value = int(part.strip()) if isinstance(part, str) else int(part)
        except ValueError:
            raise OptionError(f"<{field}> {text!r}: expected integers separated by commas, e.g. 1,4,16") from None
        if not low <= value <= high:
            raise OptionError(f"<{field}> {value}: each value must be between {low} and {high}")
        if value not in values:
            values.append(value)
    if not values:
        raise OptionError(f"<{field}>: give at least one value")
    return values
