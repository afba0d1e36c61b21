"""AWQ (Lin et al. 2023, "AWQ: Activation-aware Weight Quantization for LLM Compression and
Acceleration"): scale each input channel of a stage's linears up by s and the producer's output down
by 1/s before rounding, so the channels that carry large activations lose less; then clip each
group's range. The scaled pair computes the same function; only the rounding sees the difference.

Per block, before any linear is rounded (`transform_block`), for each stage of the family's table:
- statistics of the stage's input over the calibration tokens of the unquantized block: the mean
  |x| per channel and H = 2/N XᵀX;
- a grid search of α over n_grid points in [0, 1): s = mean|x|^α / (w_mean^(1-α) + 1e-4)
  (AutoAWQ's "duo" scaling; w_mean is the weights' per-group-normalized |w| averaged over rows),
  normalized by sqrt(max·min), scored by the error of the stage's linear outputs after rounding the
  scaled weights: Σ tr(ΔW H ΔWᵀ), ΔW = W - Q(W·s)/s. That is the paper's objective (output MSE over
  all calibration tokens), exactly, at the cost of one [in, in] product per candidate instead of a
  forward over the tokens;
- the best s folded into the producer: an RMSNorm's weight, or the rows of the linear before
  (v_proj for o_proj, up_proj for down_proj) when its outputs are the stage's inputs one for one
  (not under grouped-query attention, where AutoAWQ skips the stage too);
- then, per linear except those feeding attention scores (q, k), a search over 10 shrink factors
  of each group's max |w| (AutoAWQ's clipping), scored by the group's own output error
  ΔW_g H_gg ΔW_gᵀ with the scaled inputs' H.
Rounding follows on the target grid: round to nearest (`awq`) or GPTQ's error feedback on the
transformed block (`awq+gptq`). On a GGUF grid the searches round onto an integer grid of the same
bits and sub-block size (llama.cpp's own searches are 10-20x slower), and the final rounding
weighs columns by the scaled H's diagonal, as an imatrix.
`awq+gptq` also quantizes each block by GPTQ alone (`fallback`); the pipeline keeps whichever of the
two leaves the lower mean squared error of the block's outputs against the float block's on the
calibration tokens, so it is never worse than GPTQ there, for about GPTQ's time on top of its own.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmopt.calibration.hessian import HessianAccumulator
from llmopt.errors import InputError
from llmopt.model.families.base import Stage
from llmopt.quant.gptq import GPTQ, GPTQConfig
from llmopt.quant.grids import Grid, IntGrid
from llmopt.quant.grids.integer import OnIntGrid
from llmopt.quant.method import BlockAccess, BlockChanges, Collector, Quantized
from llmopt.options import QuantizeOptions


@dataclass(frozen=True)
class AWQConfig(OnIntGrid):
    bits: int = QuantizeOptions.bits
    group_size: int = QuantizeOptions.group_size
    sym: bool = False  # AWQ checkpoints carry a zero point per group
    mse: bool = QuantizeOptions.mse  # the grid's own min/max clipping search (AWQ clips by itself: `clip`)
    zero_min: int = 0
    sym_scale: str = "gptq"  # the symmetric grid's scale (grids/integer.py, SYM_SCALES)
    n_grid: int = 20  # α candidates in [0, 1)
    duo_scaling: bool = True  # s from activations and weights; False: activations only
    clip: bool = QuantizeOptions.clip
    clip_grid: int = 20
    max_shrink: float = 0.5  # clip candidates: max |w| × (1 - i/clip_grid) for i < max_shrink·clip_grid
    gptq: GPTQConfig | None = None  # awq+gptq: GPTQ's error feedback after AWQ's scales and clips

    @property
    def name(self) -> str:
        return "awq+gptq" if self.gptq is not None else "awq"

    def build(self) -> AWQ:
        return AWQ(self)


class ActivationStats(HessianAccumulator):
    """H = 2/N XᵀX and the mean |x| per input channel, fed chunk by chunk."""

    def __init__(self, features: int, device: torch.device | str = "cpu"):
        super().__init__(features, device)
        self.abs_sum = torch.zeros(features, dtype=torch.float64, device=device)

    def add(self, x: torch.Tensor, x_fp: torch.Tensor | None = None) -> None:
        flat = x.reshape(-1, x.shape[-1])
        self.abs_sum += flat.abs().sum(dim=0, dtype=torch.float64)
        super().add(flat)

    @property
    def abs_mean(self) -> torch.Tensor:
        return (self.abs_sum / max(self.tokens, 1)).to(torch.float32)


@functools.cache
def search_grid(grid: Grid) -> Grid:
    """The grid the searches round onto: the integer grid without its own clipping search (AWQ's
    clip search replaces it, and it would cost its 80 candidates inside each of AWQ's 30), or for a
    GGUF type an integer grid of its bits, symmetry and sub-block size (its reference search is slow).
    Grids whose codes are the levels themselves (IQ4, FP4: 8-bit codes) index 4-bit levels: `index_bits`."""
    if isinstance(grid, IntGrid):
        return dataclasses.replace(grid, mse=False)
    probe = grid.quantize(torch.linspace(-1, 1, grid.block).view(1, -1))
    return IntGrid(getattr(grid, "index_bits", grid.bits), probe.mins is None, probe.group_size)


def fake_quantize(grid: Grid, w: torch.Tensor) -> torch.Tensor:
    return grid.round_trip(w) if isinstance(grid, IntGrid) else grid.quantize(w).dequantize(torch.float32)


def output_error(delta: torch.Tensor, h: torch.Tensor) -> float:
    """tr(ΔW H ΔWᵀ): the summed squared output error over the calibration tokens (H = 2/N XᵀX)."""
    return float(((delta @ h) * delta).sum())


def group_bounds(cols: int, grid: Grid) -> list[tuple[int, int]]:
    """[start, end) of each of the grid's groups along a row (the last may be partial)."""
    gs = grid.span(cols)
    return [(g, min(g + gs, cols)) for g in range(0, cols, gs)]


def weight_mean(w: torch.Tensor, bounds: list[tuple[int, int]]) -> torch.Tensor:
    """AutoAWQ's w_mean: |w| over its group's max, averaged over the rows, per input channel."""
    a = w.abs()
    scaled = torch.cat([a[:, s:e] / (a[:, s:e].amax(dim=1, keepdim=True) + 1e-6) for s, e in bounds], dim=1)
    return scaled.mean(dim=0)


@dataclass
class ScaledStage:
    """One stage's part in a scale search: its linears' float weights, its input statistics, its grid."""

    weights: list[torch.Tensor]
    stats: ActivationStats
    grid: Grid


def best_scales(parts: list[ScaledStage], cfg: AWQConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """The α grid search over the stages that read one producer (one stage in a dense block; every
    expert's gate/up in a MoE block): the scales with the least output error of their linears, and
    what the search saw (α, the error unscaled and scaled). Each stage's error is weighed by its share
    of the tokens (an expert's routed tokens), so the sum is the squared output error over every token
    each linear saw; mean |x| pools the stages' tokens (each token reaches top-k experts: the pooled
    mean is the norm output's own)."""
    total = sum(p.stats.tokens for p in parts)
    x_mean = (sum(p.stats.abs_sum for p in parts) / max(total, 1)).to(torch.float32)
    hs = [p.stats.value() for p in parts]
    shares = [p.stats.tokens / total for p in parts]
    stacked = torch.cat([w for p in parts for w in p.weights])
    w_mean = weight_mean(stacked, group_bounds(stacked.shape[1], parts[0].grid))

    def error(s: torch.Tensor) -> float:
        return sum(share * sum(output_error(w - fake_quantize(p.grid, w * s) / s, h) for w in p.weights)
                   for p, h, share in zip(parts, hs, shares))  # fmt: skip

    plain = error(torch.ones_like(x_mean))
    best, best_s, best_ratio = float("inf"), torch.ones_like(x_mean), 0.0
    for i in range(cfg.n_grid):
        ratio = i / cfg.n_grid
        if cfg.duo_scaling:
            s = (x_mean.pow(ratio) / (w_mean.pow(1 - ratio) + 1e-4)).clamp(min=1e-4)
        else:
            s = x_mean.pow(ratio).clamp(min=1e-4)
        s = (s / (s.max() * s.min()).sqrt()).nan_to_num(nan=1.0, posinf=1.0, neginf=1.0)
        err = error(s)
        if err < best:
            best, best_s, best_ratio = err, s, ratio
    if plain <= best:  # no scaling at all can beat every candidate (reported as α = -1)
        best_s, best_ratio = torch.ones_like(x_mean), -1.0
    return best_s, {"awq_alpha": best_ratio, "awq_error_before": plain, "awq_error_after": min(best, plain)}


def best_clip(w: torch.Tensor, h: torch.Tensor, grid: Grid, cfg: AWQConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """AutoAWQ's clip search on the groups of `grid`: per row and group, the shrink of max |w| whose
    rounding has the least output error on that group's inputs (the group's diagonal block of H)."""
    rows, cols = w.shape
    bounds = group_bounds(cols, grid)
    col_group = torch.cat([torch.full((e - s,), g, dtype=torch.long) for g, (s, e) in enumerate(bounds)]).to(w.device)
    org_max = torch.stack([w[:, s:e].abs().amax(dim=1) for s, e in bounds], dim=1)  # [rows, G]

    width = max(e - s for s, e in bounds)
    pad = len(bounds) * width - cols  # a partial last group: zero columns and a zero block of H add nothing
    blocks = torch.zeros(len(bounds), width, width, dtype=h.dtype, device=h.device)  # [G, gs, gs] diagonal blocks
    for g, (s, e) in enumerate(bounds):
        blocks[g, : e - s, : e - s] = h[s:e, s:e]

    def group_errors(q: torch.Tensor) -> torch.Tensor:  # [rows, G]
        d = torch.nn.functional.pad(w - q, (0, pad)).view(rows, len(bounds), width).transpose(0, 1)  # [G, rows, gs]
        return (torch.bmm(d, blocks) * d).sum(dim=2).t()

    best_err = torch.full_like(org_max, float("inf"))
    best_max = org_max.clone()
    first = None
    for i in range(int(cfg.max_shrink * cfg.clip_grid)):
        limit = org_max * (1 - i / cfg.clip_grid)
        per_col = limit[:, col_group]
        err = group_errors(fake_quantize(grid, torch.maximum(torch.minimum(w, per_col), -per_col)))
        first = err if first is None else first
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_max = torch.where(better, limit, best_max)
    per_col = best_max[:, col_group]
    clipped = torch.maximum(torch.minimum(w, per_col), -per_col)
    shrink = float((best_max / org_max.clamp(min=1e-12)).mean())
    return clipped, {"clip_shrink": shrink, "clip_error_before": float(first.sum()),
                     "clip_error_after": float(best_err.sum())}  # fmt: skip


class AWQ:
    """The method (see the module docstring): `transform_block` scales and clips a block in place,
    `quantize_stage` then rounds (or hands the stage to GPTQ for awq+gptq)."""

    calibrated = True

    def __init__(self, config: AWQConfig):
        self.config = config
        self.name = config.name
        self.gptq = GPTQ(config.gptq) if config.gptq is not None else None
        # awq+gptq is never worse than its GPTQ alone on a block's output (the pipeline runs both, keeps the better;
        # GPTQ holds no state between stages, so the one instance serves both)
        self.fallback = self.gptq
        self.stage_statistics = self.gptq is not None
        self.full_precision_inputs = bool(self.gptq and self.gptq.full_precision_inputs)
        self.importance: dict[str, torch.Tensor] = {}  # per linear: the scaled inputs' diag H (GGUF rounding)
        self.details: dict[str, dict[str, float]] = {}

    def block_collector(self, features: int, device: torch.device) -> Collector | None:
        return ActivationStats(features, device)

    def collector(self, features: int, device: torch.device) -> Collector | None:
        return self.gptq.collector(features, device) if self.gptq is not None else None

    def transform_block(self, block: BlockAccess) -> BlockChanges:
        cfg = self.config
        changed: set[str] = set()
        scaled_h: dict[str, torch.Tensor] = {}
        seen: dict[str, int] = {}  # per linear: the calibration tokens it saw (an expert: those routed to it)
        self.importance.clear()
        self.details.clear()
        for producer_name, members in _by_producer(block):
            producer = block.module(producer_name)
            consumers = [block.module(n) for stage, _ in members for n in stage.linears]
            parts = [ScaledStage([block.module(n).weight.data.float() for n in stage.linears], stats,
                                 search_grid(block.grid(stage.linears[0]))) for stage, stats in members if stats.tokens]  # fmt: skip
            fold = _foldable(producer, consumers[0], block.name(producer_name)) and bool(parts)
            info: dict[str, float] = {}
            if fold:
                s, info = best_scales(parts, cfg)
                _fold(producer, s)
                readers = block.readers.get(producer_name, ())
                for m in consumers + [block.module(r) for r in readers]:  # the router reads x / s too
                    m.weight.data = (m.weight.data.float() * s).to(m.weight.dtype)
                if not isinstance(producer, nn.Linear) or getattr(producer, "bias", None) is not None:
                    changed.add(producer_name)  # a norm; a linear's bias (its weight is quantized anyway)
                changed.update(readers)
            for stage, stats in members:
                h = stats.value()
                if fold:
                    h = h / s.unsqueeze(1) / s.unsqueeze(0)  # the inputs are now x / s
                for name in stage.linears:
                    scaled_h[name], seen[name] = h, stats.tokens
                    self.details[block.name(name)] = dict(info)
        if cfg.clip:
            for stage in block.stages:
                for name in stage.linears:
                    if name in block.score_linears or not seen[name]:  # q·k misjudges; no tokens: nothing to clip by
                        continue
                    m = block.module(name)
                    grid = search_grid(block.grid(name))
                    clipped, info = best_clip(m.weight.data.float(), scaled_h[name], grid, cfg)
                    m.weight.data = clipped.to(m.weight.dtype)
                    self.details[block.name(name)].update(info)
        for name, h in scaled_h.items():
            details = self.details[block.name(name)]
            details["calibration_tokens"] = seen[name]
            if seen[name]:
                self.importance[block.name(name)] = torch.diag(h).clone()
            else:  # an expert no calibration token reached: no scale, no clip, rounded to nearest
                details["rtn_fallback"] = 1
        return BlockChanges(changed)

    def quantize_stage(self, weights: dict[str, torch.Tensor], grids: dict[str, Grid],
                       stats: Collector | None) -> dict[str, Quantized]:
        if self.gptq is not None:
            done = self.gptq.quantize_stage(weights, grids, stats)
        else:
            done = {}
            for name, w in weights.items():
                grid = grids[name]
                importance = None if isinstance(grid, IntGrid) else self.importance.get(name)
                done[name] = Quantized(grid.quantize(w, importance))
        for name, q in done.items():
            q.details = {**self.details.get(name, {}), **q.details}
        return done

    def provenance(self) -> dict[str, Any]:
        c = self.config
        out: dict[str, Any] = {"n_grid": c.n_grid, "duo_scaling": c.duo_scaling, "clip": c.clip}
        if self.gptq is not None:
            out["gptq"] = self.gptq.provenance()
        return out


def _by_producer(block: BlockAccess) -> list[tuple[str, list[tuple[Stage, ActivationStats]]]]:
    """The stages grouped by the module whose output they read, in stage order: one scale serves them
    all, as it is folded into that one module (a MoE block's experts all read its post-attention norm).
    A stage whose forward never ran gets empty statistics."""
    groups: dict[str, list[tuple[Stage, ActivationStats]]] = {}
    for stage, st in zip(block.stages, block.stats):
        if st is None:
            weight = block.module(stage.linears[0]).weight
            st = ActivationStats(weight.shape[1], weight.device)
        groups.setdefault(stage.producer, []).append((stage, st))
    return list(groups.items())


def _foldable(producer: nn.Module, consumer: nn.Module, producer_name: str) -> bool:
    """Whether 1/s can be folded into the producer: a norm's weight, or a linear whose outputs are the
    consumers' inputs one for one (False for grouped-query v_proj -> o_proj: skipped, as AutoAWQ)."""
    if isinstance(producer, nn.Linear):
        return producer.out_features == consumer.in_features
    weight = getattr(producer, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 1 and weight.numel() == consumer.in_features:
        return True
    raise InputError(f"{producer_name}: AWQ cannot fold its scales into this module (not a norm or a linear "
                     "whose outputs feed the stage one for one)")


def _fold(producer: nn.Module, s: torch.Tensor) -> None:
    """Divide the producer's output channels by s (its weight, and its bias if it has one)."""
    if isinstance(producer, nn.Linear):
        producer.weight.data = (producer.weight.data.float() / s.unsqueeze(1)).to(producer.weight.dtype)
    else:  # a norm scales by (shift + weight): Gemma's shift 1 stays outside the division
        shift = getattr(producer, "shift", 0.0)
        producer.weight.data = ((shift + producer.weight.data.float()) / s - shift).to(producer.weight.dtype)
    bias = getattr(producer, "bias", None)
    if isinstance(bias, torch.Tensor):
        bias.data = (bias.data.float() / s).to(bias.dtype)
