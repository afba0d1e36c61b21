"""The paused forward (quant/staged.py): each stage sees its input with the earlier stages' new
weights, the arithmetic is the plain loop's, and a stopped run unwinds its paused forwards."""

import pytest
import torch
from torch import nn

from llmopt.model.families.base import Stage
from llmopt.quant.staged import StagedForward


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.c(torch.relu(self.b(self.a(x))))


STAGES = (Stage(("a",), "x", "a"), Stage(("b",), "a", "b"), Stage(("c",), "b", "c"))


def test_each_stage_sees_the_earlier_stages_new_weights() -> None:
    toy = Toy()
    x = torch.randn(3, 5, 8)
    seen = []
    with StagedForward(toy, STAGES, lambda i: toy(x[i]), 3) as staged:
        for k, name in enumerate("abc"):
            seen.append(torch.stack([inp for _, inp in staged.inputs(k)]))
            getattr(toy, name).weight.data *= 0.5  # "quantize" the stage
        out = torch.stack([y for _, y in staged.outputs()])
    def per_sample(f):  # as the stages ran: one sample at a time (a batched GEMM may round otherwise)
        return torch.stack([f(x[i]) for i in range(len(x))])

    with torch.no_grad():
        assert torch.equal(seen[0], x)
        assert torch.equal(seen[1], per_sample(toy.a))  # a's halved weight
        assert torch.equal(seen[2], per_sample(lambda v: torch.relu(toy.b(toy.a(v)))))
        assert torch.equal(out, per_sample(toy))


def test_a_stage_table_out_of_forward_order_is_refused() -> None:
    toy = Toy()
    x = torch.randn(2, 8)
    with StagedForward(toy, (STAGES[1], STAGES[0]), lambda i: toy(x[i]), 2) as staged:
        with pytest.raises(RuntimeError, match="not in forward order"):
            list(staged.inputs(0))


def test_errors_surface_and_paused_forwards_unwind() -> None:
    toy = Toy()
    x = torch.randn(2, 8)
    unwound = []

    def forward(i):
        try:
            return toy(x[i])
        finally:
            unwound.append(i)

    with pytest.raises(KeyError):
        with StagedForward(toy, STAGES, forward, 2) as staged:
            list(staged.inputs(0))
            raise KeyError("the method failed")
    assert sorted(unwound) == [0, 1]  # both paused forwards ran their cleanup
    assert not toy.a._forward_pre_hooks  # and the hooks are gone
