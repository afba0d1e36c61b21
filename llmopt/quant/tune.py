"""Learned rounding: each block's codes and group scales tuned against the float model's block output.

A method (RTN, GPTQ, AWQ, AWQ+GPTQ) rounds each linear on its own, against its own layer's error.
Tuning then looks at the whole block: for every linear on an evenly spaced grid or a set of levels
(`tunable`) it learns an offset per weight (`v`, within half a code) and, where the format stores scales
as float16 (the integer grid), a gain per group scale, and keeps those that make the block's output
closest to the float model's (mean squared error over the calibration tokens; the pipeline runs the
block on the quantized model's inputs and takes the targets from the float model's, so each block also
makes up for the error of the blocks before it). The steps
are signed gradient steps with a learning rate that falls linearly to zero (SignRound, Cheng et
al. 2023), the gains' a fifth of the offsets' after GPTQ or AWQ (a gain moves every code of its group at
once) and the offsets' own from round-to-nearest (`TuneConfig.for_method`), through a straight-through
rounding:

    q = clamp(round(w / (s·(1+g)) + z + d0 + v), 0, 2**bits - 1),   ŵ = (q - z)·s·(1+g)

`d0` moves each weight by whole codes from where round-to-nearest puts it to the method's own
code, keeping its distance to the nearest rounding boundary: v = 0, g = 0 is exactly the method's
answer (tuning starts from GPTQ's or AWQ's result; with RTN it is AutoRound's start), and a weight
that sat near a boundary is as easy to move across it as in SignRound. (Starting each weight at the
centre of its code instead, d0 = q0 − w/s − z, would put every code half a step from a boundary:
offsets within half a step could never move one.) Of the offsets after the last step and those with the lowest step loss, the
ones with the lower error over all the calibration tokens are kept, and only where that error is
below the method's: tuning never makes a block worse on them than the method it starts from.
Steps draw `batch_size` samples from a generator seeded with (`seed`, block index): the same seed,
the same codes.

A grid whose codes are a set of integers rather than all of them (FP4's 15 levels, FP8's 253,
`Grid.code_levels`) is tuned the same way along its levels: u is placed between its two neighbouring
levels (position k + a fraction), the offsets move the position, the code is the level at the rounded
position, and the gradient flows through the straight line between the two levels. On evenly spaced
codes the position is the code, and the two are one.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call

from llmopt.quant.grids import Grid
from llmopt.quantized_tensor import QuantizedTensor

GAIN_RANGE = (-0.5, 0.2)  # a group's scale may shrink to half (clipping) or grow by a fifth
# Measured (docs/quantize.md, "Step sizes"): at 20 steps AutoRound's 1/iters (0.05) flipped a quarter of a w3
# block's codes and left held-out error worse than GPTQ's; 0.005-0.01 lowered it by a fifth to a quarter. The
# scale gains, which move every code of a group at once, did best at a fifth of the offsets' step from GPTQ's
# answer (its codes were chosen for its scales); from round-to-nearest's min-max scales at the offsets' own step,
# as AutoRound's minmax_lr (w2 g64, 20 steps: KL 1.619 against 1.715 at a fifth).
MAX_DEFAULT_LR = 0.01
SCALE_LR_DIVISOR = 5
# Steps × weights of a block from which the integer grid's rounding arithmetic is compiled (torch inductor fuses
# its dozen element-wise passes over every weight, forward and backward, into one each). Measured on a SmolLM2
# block (3.5 M weights, 4 × 256 tokens, this 2-core CPU): a step 0.197 s eager, 0.156 s compiled, for 13.8 s of
# compiling once per process (inductor caches it on disk): worth it from ~1e8 and more steps × weights.
COMPILE_MIN_WORK = 1e8

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TuneConfig:
    """Learned rounding's options (QuantizeOptions.iters, lr, batch_size, seed, scale_lr; the default scale step
    depends on the method it starts from)."""

    iters: int = 200
    lr: float | None = None  # None: 1 / iters (AutoRound's default) up to MAX_DEFAULT_LR
    batch_size: int = 8  # calibration samples per step
    seed: int = 0
    scale_lr: float | None = None  # the scale gains' step size; None: lr / scale_divisor
    scale_divisor: float = SCALE_LR_DIVISOR  # 1 from round-to-nearest (`for_method`)

    @property
    def rate(self) -> float:
        return self.lr if self.lr is not None else min(1.0 / self.iters, MAX_DEFAULT_LR)

    @property
    def scale_rate(self) -> float:
        return self.scale_lr if self.scale_lr is not None else self.rate / self.scale_divisor

    @staticmethod
    def for_method(method: str, iters: int, lr: float | None, batch_size: int, seed: int,
                   scale_lr: float | None) -> TuneConfig:  # fmt: skip
        """The options tuning `method`'s answer: from round-to-nearest the scales step as the offsets do."""
        return TuneConfig(iters, lr, batch_size, seed, scale_lr, 1.0 if method == "rtn" else SCALE_LR_DIVISOR)


@dataclass
class _Linear:
    """One linear's tuning state: its float weight, the method's result and the learned offsets."""

    weight: torch.Tensor  # float32 [out, in], what the method rounded
    start: QuantizedTensor
    scale: torch.Tensor  # float32 [out or 1, groups]
    zero: torch.Tensor  # float32, broadcast like `scale`
    columns: torch.Tensor  # [in] group of each column
    offset: torch.Tensor  # d0: the method's codes relative to w / s + z, as positions on the levels
    v: torch.Tensor  # learned rounding offset, [-0.5, 0.5]
    gain: torch.Tensor  # learned scale gain per group
    positions: Positions  # where the codes lie, as positions the offsets move

    @classmethod
    def of(cls, weight: torch.Tensor, start: QuantizedTensor, levels: tuple[int, ...] | None = None) -> _Linear:
        scale = start.scales.to(torch.float32)
        if start.mins is not None:  # ŵ = q·s − m: the zero point m/s (a sub-block with s = 0 keeps its codes)
            zero = torch.where(scale != 0, start.mins.to(torch.float32) / scale, torch.zeros_like(scale))
        elif start.zeros is not None:
            zero = start.zeros.to(torch.float32)
        else:
            zero = torch.full_like(scale, float(1 << (start.bits - 1)))
        columns = start.group_index()
        s = scale[:, columns]
        positions = Positions.of(levels, start.bits, weight.device)
        u = positions.position(weight / torch.where(s != 0, s, 1.0) + zero[:, columns])  # where each weight sits between codes
        # the method's code, each weight keeping its distance to the nearest rounding boundary (nudged off a tie)
        offset = positions.position(start.codes.to(torch.float32)) - u + (u - torch.round(u)).clamp(-0.49, 0.49)
        v = torch.zeros_like(weight, requires_grad=True)
        # a scale a checkpoint stores as a float16 may change; GGUF and FP4 types store theirs as codes, and FP8's
        # row scales did better kept (off-grid SmolLM2, 20 steps from round-to-nearest: KL 0.00736 kept, 0.00774 learned)
        gain = torch.zeros_like(scale, requires_grad=start.grid == "int")
        return cls(weight, start, scale, zero, columns, offset, v, gain, positions)

    def codes(self, scale: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Codes (float, straight-through rounded) for per-column `scale` and offsets `v`."""
        if self.positions.table is None:
            return even_codes(self.weight, scale, self.zero[:, self.columns], self.offset, v, self.positions.top)
        u = self.weight / torch.where(scale != 0, scale, 1.0) + self.zero[:, self.columns]
        return self.positions.code(self.positions.position(u) + self.offset + v)

    def dequantized(self, rounding: Callable | None = None) -> torch.Tensor:
        """ŵ with the current offsets and gains, differentiable in both; on evenly spaced codes by `rounding`
        (`fake_quantized`, or its compiled copy)."""
        if self.positions.table is None:
            return (rounding or fake_quantized)(self.weight, self.scale * (1 + self.gain), self.zero, self.columns,
                                                self.offset, self.v, self.positions.top)  # fmt: skip
        scale = (self.scale * (1 + self.gain))[:, self.columns]
        return (self.codes(scale, self.v) - self.zero[:, self.columns]) * scale

    def result(self) -> QuantizedTensor:
        """The tuned codes on the scales the format stores (the integer grid's float16-exact, as the method's
        were; a GGUF, FP4 or FP8 type's unchanged)."""
        with torch.no_grad():
            scale = self.scale * (1 + self.gain)
            if self.gain.requires_grad:
                scale = scale.to(torch.float16).to(torch.float32).clamp(min=2.0**-24)
            codes = self.codes(scale[:, self.columns], self.v)
        scales = scale if self.gain.requires_grad else self.start.scales
        return dataclasses.replace(self.start, codes=codes.to(self.start.codes.dtype), scales=scales)

    def step(self, rate: float, scale_rate: float) -> None:
        """One signed gradient step, offsets and gains kept in their ranges."""
        with torch.no_grad():
            for p, r, (lo, hi) in ((self.v, rate, (-0.5, 0.5)), (self.gain, scale_rate, GAIN_RANGE)):
                if p.grad is not None:  # (a gain that is not learned has none)
                    p.sub_(r * torch.sign(p.grad)).clamp_(lo, hi)
                    p.grad = None

    def state(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.v.detach().clone(), self.gain.detach().clone()

    def restore(self, state: tuple[torch.Tensor, torch.Tensor]) -> None:
        with torch.no_grad():
            self.v.copy_(state[0])
            self.gain.copy_(state[1])


def round_clamped(x: torch.Tensor, top: int) -> torch.Tensor:
    """x rounded to 0..top, the gradient passing straight through the rounding (and half a step past either end)."""
    return torch.clamp(x + (torch.round(x) - x).detach(), 0, top)


def even_codes(weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, offset: torch.Tensor, v: torch.Tensor,
               top: int) -> torch.Tensor:  # fmt: skip
    """Codes on evenly spaced levels 0..top (per-column `scale`, `zero`): the method's moved by the offsets."""
    return round_clamped(weight / torch.where(scale != 0, scale, 1.0) + zero + offset + v, top)


def fake_quantized(weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, columns: torch.Tensor,
                   offset: torch.Tensor, v: torch.Tensor, top: int) -> torch.Tensor:  # fmt: skip
    """ŵ on evenly spaced codes from per-group `scale` and `zero`: what a step differentiates, one expression
    that compiles to one fused pass (`compiled_fake_quantized`)."""
    s, z = scale[:, columns], zero[:, columns]
    return (even_codes(weight, s, z, offset, v, top) - z) * s


@functools.cache
def compiled_fake_quantized() -> Callable:
    return torch.compile(fake_quantized, dynamic=False)


_compile_failed: list[str] = []  # why compiling failed in this process, once it has: it is not tried again


def _rounding_for(work: float) -> Callable:
    return compiled_fake_quantized() if work >= COMPILE_MIN_WORK and not _compile_failed else fake_quantized


def _uncompiled_after(error: Exception) -> Callable:
    _compile_failed.append(str(error).splitlines()[0] if str(error) else type(error).__name__)
    log.warning("learned rounding: compiling its arithmetic failed (%s); it runs uncompiled", _compile_failed[0])
    return fake_quantized


@dataclass(frozen=True)
class Positions:
    """The codes a weight may take, as positions 0..n−1: every integer of `bits` (`table` None: the position is
    the code), or an ascending set of them (`Grid.code_levels`), between which a position is a straight line."""

    top: int  # the last position
    table: torch.Tensor | None  # float32 [n] the codes, ascending; None: 0..top

    @staticmethod
    def of(levels: tuple[int, ...] | None, bits: int, device: torch.device) -> Positions:
        if levels is None:
            return Positions((1 << bits) - 1, None)
        return Positions(len(levels) - 1, torch.tensor(levels, dtype=torch.float32, device=device))

    def position(self, u: torch.Tensor) -> torch.Tensor:
        """Where code-valued `u` lies on the levels, clamped to the ends (exact at a level)."""
        if self.table is None:
            return u
        k = (torch.searchsorted(self.table, u.detach().contiguous(), right=True) - 1).clamp(0, self.top - 1)
        lo, hi = self.table[k], self.table[k + 1]
        return (k + (u - lo) / (hi - lo)).clamp(0, self.top)

    def code(self, x: torch.Tensor) -> torch.Tensor:
        """The code at rounded position `x` (float), its gradient that of the line through the two levels
        around x (straight-through)."""
        if self.table is None:
            return round_clamped(x, self.top)
        x = x.clamp(0, self.top)
        k = torch.floor(x.detach()).clamp(max=self.top - 1).long()
        lo, hi = self.table[k], self.table[k + 1]
        line = lo + (x - k) * (hi - lo)
        return line + (self.table[torch.round(x.detach()).long()] - line).detach()


def tunable(grid: Grid) -> bool:
    """Whether learned rounding applies to a linear's grid: every weight s·q − m with codes evenly spaced
    (the integer grid of GPTQ/AWQ/compressed-tensors checkpoints, GGUF's legacy and K types) or on a set of
    levels (FP4: MXFP4, NVFP4; FP8); not codebooks (IQ4: llama.cpp could not run a tuned IQ4_NL file) nor lattices."""
    return bool(getattr(grid, "uniform", False)) or getattr(grid, "code_levels", None) is not None


def tune_block(block: nn.Module, weights: dict[str, torch.Tensor], start: dict[str, QuantizedTensor],
               forward: Callable[[nn.Module, dict[str, torch.Tensor], slice], torch.Tensor],
               targets: torch.Tensor, config: TuneConfig, layer: int,
               levels: Mapping[str, tuple[int, ...] | None] | None = None) -> tuple[dict[str, QuantizedTensor], dict[str, float]]:  # fmt: skip
    """Tune the linears of one block (block-relative name -> float weight, and the method's result).

    `forward(block, weights, samples)` runs the block on calibration samples with the given linear
    weights; `targets` [n, t, hidden] the float model's outputs of the block; `levels` the codes of a
    linear whose grid has a set of them (`Grid.code_levels`). Returns the tuned results (or the start,
    where tuning did not lower the error over every sample) and the block's losses."""
    levels = levels or {}
    linears = {name: _Linear.of(weights[name], start[name], levels.get(name)) for name in start}
    n = targets.shape[0]
    batch = min(config.batch_size, n)
    generator = torch.Generator().manual_seed(config.seed * 1_000_003 + layer)
    work = config.iters * sum(lin.weight.numel() for lin in linears.values())
    rounding = _rounding_for(work)

    def loss(samples: slice | torch.Tensor) -> torch.Tensor:
        ws = {f"{name}.weight": lin.dequantized(rounding) for name, lin in linears.items()}
        return torch.nn.functional.mse_loss(forward(block, ws, samples).to(torch.float32), targets[samples])

    before = whole_with(block, forward, targets, start, batch)
    best, best_state = float("inf"), None
    for p in block.parameters():  # only the offsets and gains learn: no gradient for norms, biases, nor the
        p.requires_grad_(False)  # inputs of the block's first linears
    with torch.enable_grad():
        for it in range(config.iters):
            samples = torch.randperm(n, generator=generator)[:batch]
            try:
                value = loss(samples)
            except Exception as e:  # no compiler here, or inductor failed: the same arithmetic, eager
                if rounding is fake_quantized:
                    raise
                rounding = _uncompiled_after(e)
                value = loss(samples)
            if float(value.detach()) < best:  # the offsets that gave this loss, before the step moves them
                best, best_state = float(value.detach()), {name: lin.state() for name, lin in linears.items()}
            value.backward()
            decay = 1 - it / config.iters
            for lin in linears.values():
                lin.step(config.rate * decay, config.scale_rate * decay)
    # the offsets after the last step, and those of the lowest step loss (a loss on a few samples):
    # whichever gives the lower error over every sample, if lower than the method's own
    chosen, after = dict(start), before
    for state in (None, best_state):
        if state is not None:
            for name, lin in linears.items():
                lin.restore(state[name])
        tuned = {name: lin.result() for name, lin in linears.items()}
        error = whole_with(block, forward, targets, tuned, batch)
        if error < after:
            chosen, after = tuned, error
    details = {"tune_start_mse": before, "tune_mse": after, "tune_kept": float(after < before)}
    return chosen, details


def whole_with(block: nn.Module, forward: Callable, targets: torch.Tensor, results: dict[str, QuantizedTensor],
               batch: int) -> float:  # fmt: skip
    """The block's mean squared error over every sample with these results' dequantized weights."""
    n = targets.shape[0]
    weights = {f"{name}.weight": qt.dequantize(torch.float32) for name, qt in results.items()}
    total = 0.0
    with torch.no_grad():
        for i in range(0, n, batch):
            s = slice(i, min(i + batch, n))
            total += float(torch.nn.functional.mse_loss(forward(block, weights, s).to(torch.float32), targets[s])) * (s.stop - s.start)
    return total / n


def block_forward(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Callable:
    """`forward` for `tune_block`: the block on samples of `x` with its linears' weights replaced."""

    def forward(block: nn.Module, weights: dict[str, torch.Tensor], samples: slice | torch.Tensor) -> torch.Tensor:
        return functional_call(block, weights, (x[samples], cos, sin))

    return forward
