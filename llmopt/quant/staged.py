"""A block's own forward over every calibration chunk, paused where each stage's input is ready.

Quantizing a block stage by stage (GPTQ's true-sequential order) needs each stage's input computed
with the earlier stages already quantized. Running the block from its input once per stage would
compute the attention three times over. Instead each chunk's forward is a coroutine (a greenlet)
that stops at a hook on the stage's linears: `inputs(k)` resumes the chunks one after another
until each reaches stage k and hands over what that stage receives; after the stage is quantized
(its weights replaced in place), `inputs(k + 1)` lets every forward go on from where it stopped,
with the new weights. `outputs()` runs them to the end.

The chunks always run in order and one at a time, so the arithmetic is exactly that of a loop over
chunks, and nothing is computed twice. Greenlets rather than threads: they all run on the calling
thread, so torch's OpenMP pool is not shared with parked threads (each OS thread that runs torch
ops gets a team of its own, and more managed threads than cores makes OpenMP throttle its
spinning: the small ops of GPTQ's column loop ran 2x slower that way). The forward is whatever
the family's block does: the pipeline never restates it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
from greenlet import getcurrent, greenlet
from torch import nn

from llmopt.model.families.base import Stage


class _Abort(Exception):
    """Thrown into a paused forward to unwind it when the pipeline stops early."""


class StagedForward:
    """`forward(i)` for chunks i = 0..n-1, paused before each stage's linears (see the module docstring)."""

    def __init__(self, block: nn.Module, stages: Sequence[Stage], forward: Callable[[int], torch.Tensor], n: int):
        self.forward = forward
        self.coroutines: list[greenlet | None] = [None] * n
        self.passed: dict[greenlet, set[int]] = {}  # stages each forward has gone past
        self.hooks = []
        for k, stage in enumerate(stages):
            for name in stage.linears:
                self.hooks.append(block.get_submodule(name).register_forward_pre_hook(self._pause_at(k)))

    def _pause_at(self, k: int) -> Callable:
        def pause(_module: nn.Module, args: tuple) -> None:
            me = getcurrent()
            passed = self.passed.get(me)
            if passed is None or k in passed:  # not one of ours, or a later linear of the same stage
                return
            passed.add(k)
            me.parent.switch(("stage", k, args[0]))  # back to the pipeline; resumed by its next switch()

        return pause

    def _resume(self, i: int) -> tuple:
        g = self.coroutines[i]
        if g is None:
            g = self.coroutines[i] = greenlet(lambda: ("done", self.forward(i)))
            self.passed[g] = set()
        return g.switch()

    def inputs(self, k: int) -> Iterator[tuple[int, torch.Tensor]]:
        """Each chunk's input to stage k, in chunk order (the forward waits there until the next call)."""
        for i in range(len(self.coroutines)):
            event = self._resume(i)
            if event[0] != "stage" or event[1] != k:
                reached = f"stage {event[1]}" if event[0] == "stage" else "the block's end"
                raise RuntimeError(f"the block's forward reached {reached} before stage {k}: "
                                   "the family's stage table is not in forward order")  # fmt: skip
            yield i, event[2]

    def outputs(self) -> Iterator[tuple[int, torch.Tensor]]:
        """Each chunk's block output, running every forward to its end."""
        for i in range(len(self.coroutines)):
            event = self._resume(i)
            if event[0] != "done":
                raise RuntimeError(f"the block's forward paused at stage {event[1]} after the last stage")
            self.passed.pop(self.coroutines[i], None)
            self.coroutines[i] = None
            yield i, event[1]

    def close(self) -> None:
        """Remove the hooks and unwind any forward still paused."""
        for h in self.hooks:
            h.remove()
        for g in self.coroutines:
            if g is not None and not g.dead:
                try:
                    g.throw(_Abort)
                except _Abort:
                    pass
        self.coroutines = []
        self.passed.clear()

    def __enter__(self) -> StagedForward:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
