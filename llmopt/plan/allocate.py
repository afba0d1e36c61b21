"""One choice per item under a byte budget, least total cost: the multiple-choice knapsack of mixed precision.

Each item (a tensor) has options (a type, its bytes, its predicted cost). `allocate` solves it
twice and keeps the cheaper answer:

- Greedy: every item starts at its smallest option; along each item's lower convex hull of
  (bytes, cost), the upgrade that buys the most cost per byte goes first (a heap of next steps).
  This is the Lagrangian solution, optimal for every budget it lands on exactly, but it can stop
  short when one item's next step is large.
- Dynamic programming over the budget in coarse units (sizes rounded up, so its answer fits):
  exact up to that rounding, whatever the steps.

Both are then filled: single moves to any larger option that lowers the cost and fits, the largest
reduction first. So the result never exceeds the budget, and the bytes left are fewer than any
item's step to an option of lower cost.
Ties break by item order, then option order: the same input gives the same choice.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from llmopt.errors import OptionError


@dataclass(frozen=True)
class Option:
    name: str
    nbytes: int
    cost: float


@dataclass(frozen=True)
class Allocation:
    choice: list[int]  # per item, the index of its chosen option
    nbytes: int
    cost: float


def smallest(items: Sequence[Sequence[Option]]) -> int:
    """Bytes of the smallest possible choice."""
    return sum(min(o.nbytes for o in options) for options in items)


def allocate(items: Sequence[Sequence[Option]], budget: int) -> Allocation:
    """The choice of one option per item with total bytes <= `budget` and (near-)least total cost."""
    if any(not options for options in items):
        raise ValueError("every item needs at least one option")
    floor = smallest(items)
    if budget < floor:
        raise OptionError(f"the smallest possible choice takes {floor} bytes, more than the {budget} allowed")
    answers = [_greedy(items, budget), _dynamic(items, budget)]
    for choice in answers:
        _fill(items, choice, sum(items[i][c].nbytes for i, c in enumerate(choice)), budget)
    best = min(answers, key=lambda choice: sum(items[i][c].cost for i, c in enumerate(choice)))
    return Allocation(best, sum(items[i][c].nbytes for i, c in enumerate(best)),
                      sum(items[i][c].cost for i, c in enumerate(best)))  # fmt: skip


DP_UNITS = 20_000  # budget resolution of the dynamic program


def _dynamic(items: Sequence[Sequence[Option]], budget: int) -> list[int]:
    """Least cost with every size rounded up to whole units of budget/DP_UNITS (so it fits)."""
    unit = max(1, -(-budget // DP_UNITS))
    units = budget // unit
    best = np.zeros(units + 1)  # least cost of the items so far within b units
    picks = np.zeros((len(items), units + 1), dtype=np.int16)
    for i, options in enumerate(items):
        new = np.full(units + 1, np.inf)
        for k, option in enumerate(options):
            w = -(-option.nbytes // unit)
            if w > units:
                continue
            cand = np.full(units + 1, np.inf)
            cand[w:] = best[: units + 1 - w] + option.cost
            better = cand < new
            new[better] = cand[better]
            picks[i, better] = k
        best = new
    if not np.isfinite(best[units]):
        return _greedy(items, budget)  # the rounding made the budget too tight for any choice
    choice, b = [0] * len(items), units
    for i in range(len(items) - 1, -1, -1):
        k = int(picks[i, b])
        choice[i] = k
        b -= -(-items[i][k].nbytes // unit)
    return choice


def _greedy(items: Sequence[Sequence[Option]], budget: int) -> list[int]:
    """Upgrades along each item's convex hull, the most cost saved per byte first."""
    choice = [_cheapest_smallest(options) for options in items]
    used = sum(items[i][c].nbytes for i, c in enumerate(choice))
    hulls = [_hull(options) for options in items]
    position = [0] * len(items)  # index into each hull
    heap: list[tuple[float, int, int]] = []
    for i, hull in enumerate(hulls):
        _push_next(heap, items[i], hull, position[i], i)
    while heap:
        _, i, nxt = heapq.heappop(heap)
        step = items[i][hull_idx := hulls[i][nxt]].nbytes - items[i][choice[i]].nbytes
        if used + step > budget:
            continue  # this item's hull stops here; the fill pass may still find it a smaller step
        used += step
        choice[i] = hull_idx
        position[i] = nxt
        _push_next(heap, items[i], hulls[i], nxt, i)
    return choice


def _cheapest_smallest(options: Sequence[Option]) -> int:
    return min(range(len(options)), key=lambda k: (options[k].nbytes, options[k].cost, k))


def _hull(options: Sequence[Option]) -> list[int]:
    """Indices of the lower convex hull of (bytes, cost), from the smallest option up, cost falling."""
    order = sorted(range(len(options)), key=lambda k: (options[k].nbytes, options[k].cost, k))
    frontier: list[int] = []
    for k in order:  # keep only options that lower the cost (Pareto front)
        if not frontier or options[k].cost < options[frontier[-1]].cost:
            frontier.append(k)
    hull: list[int] = []
    for k in frontier:  # then the convex part of it (slopes get flatter)
        while len(hull) >= 2 and _slope(options, hull[-2], hull[-1]) >= _slope(options, hull[-1], k):
            hull.pop()
        hull.append(k)
    return hull


def _slope(options: Sequence[Option], a: int, b: int) -> float:
    """Cost change per byte from option a to option b (negative: b is better)."""
    return (options[b].cost - options[a].cost) / (options[b].nbytes - options[a].nbytes)


def _push_next(heap: list, options: Sequence[Option], hull: list[int], pos: int, item: int) -> None:
    if pos + 1 < len(hull):
        heapq.heappush(heap, (_slope(options, hull[pos], hull[pos + 1]), item, pos + 1))


def _fill(items: Sequence[Sequence[Option]], choice: list[int], used: int, budget: int) -> int:
    """Single upgrades that fit, largest cost reduction first, until none fits."""
    while True:
        best: tuple[float, int, int] | None = None
        for i, options in enumerate(items):
            current = options[choice[i]]
            for k, option in enumerate(options):
                step = option.nbytes - current.nbytes
                gain = current.cost - option.cost
                if step > 0 and used + step <= budget and gain > 0 and (best is None or gain > best[0]):
                    best = (gain, i, k)
        if best is None:
            return used
        _, i, k = best
        used += items[i][k].nbytes - items[i][choice[i]].nbytes
        choice[i] = k
