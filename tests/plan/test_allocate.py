"""The mixed-precision knapsack: never over budget, fills it to within one step, optimal where the
Lagrangian is exact, and the same answer for the same input."""

from __future__ import annotations

import itertools
import random

import pytest

from llmopt.errors import OptionError
from llmopt.plan.allocate import Option, allocate, smallest


def _items(seed: int, n: int = 6) -> list[list[Option]]:
    """Items shaped like tensors: each larger type costs less, with diminishing returns and some noise."""
    rng = random.Random(seed)
    items = []
    for _ in range(n):
        rows = rng.choice([1, 2, 4, 8])
        sens = rng.uniform(0.1, 10)
        opts = []
        for bits in (2.6, 3.4, 4.5, 5.0, 5.5, 6.6, 8.5):
            opts.append(Option(f"b{bits}", int(rows * bits * 32), sens * 2 ** (-2 * bits) * rng.uniform(0.7, 1.3)))
        items.append(opts)
    return items


def _brute_force(items: list[list[Option]], budget: int) -> float:
    best = float("inf")
    for choice in itertools.product(*(range(len(o)) for o in items)):
        if sum(items[i][k].nbytes for i, k in enumerate(choice)) <= budget:
            best = min(best, sum(items[i][k].cost for i, k in enumerate(choice)))
    return best


@pytest.mark.parametrize("seed", range(5))
def test_within_budget_and_filled_to_one_step(seed: int) -> None:
    items = _items(seed)
    floor, top = smallest(items), sum(max(o.nbytes for o in opts) for opts in items)
    for budget in range(floor, top + 1, max(1, (top - floor) // 37)):
        result = allocate(items, budget)
        assert result.nbytes == sum(items[i][k].nbytes for i, k in enumerate(result.choice)) <= budget
        slack = budget - result.nbytes
        for i, opts in enumerate(items):  # no single move to a better option still fits
            current = opts[result.choice[i]]
            for o in opts:
                if o.nbytes > current.nbytes and o.cost < current.cost:
                    assert o.nbytes - current.nbytes > slack


@pytest.mark.parametrize("seed", range(3))
def test_close_to_the_exact_optimum(seed: int) -> None:
    items = _items(seed, n=4)
    floor, top = smallest(items), sum(max(o.nbytes for o in opts) for opts in items)
    for budget in [*range(floor, top + 1, max(1, (top - floor) // 11)), top]:
        exact = _brute_force(items, budget)
        assert allocate(items, budget).cost <= exact * 1.05 + 1e-12, budget


def test_the_same_input_gives_the_same_choice() -> None:
    items = _items(7, n=20)
    budget = (smallest(items) + sum(max(o.nbytes for o in opts) for opts in items)) // 2
    assert allocate(items, budget) == allocate([list(o) for o in items], budget)


def test_a_budget_below_the_smallest_choice_is_refused() -> None:
    items = _items(1)
    with pytest.raises(OptionError, match=f"smallest possible choice takes {smallest(items)} bytes"):
        allocate(items, smallest(items) - 1)
