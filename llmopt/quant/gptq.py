"""GPTQ (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers"): quantize a linear layer column by column, pushing each column's rounding error onto
the columns not yet quantized, weighted by the inverse Hessian H = 2 XᵀX of the layer's inputs.

Implementation notes (our own, following the paper's algorithm):
- H⁻¹ is taken as the upper Cholesky factor of the inverse of the damped Hessian; damping is
  `damp` × mean(diag H), increased by `damp_step` until Cholesky succeeds (the layer is reported).
- Dead inputs (diag H == 0, never active in calibration) get H_ii = 1 and weight 0.
- Lazy batch updates: errors are applied inside a block of `block_size` columns, and to the rest
  of the matrix once per block.
- Group parameters are chosen when a group starts, from the error-updated weights (as the paper's
  code does); `static_groups` chooses them all up front from the original weights, which keeps
  groups contiguous under act-order.
- `act_order` (desc_act) processes columns by decreasing H_ii; without static groups, groups are
  formed in that order and `g_idx` records each input column's group.
- `group_aware` (GPTQModel's act_group_aware): act-order that keeps the groups contiguous. Groups
  are processed by decreasing max H_ii, and the columns inside each group by decreasing H_ii; each
  group's parameters are chosen when it starts, from the error-updated weights. The checkpoint
  needs no g_idx, so fast contiguous-group kernels still apply.
- `fp_target` (GPTAQ, Li et al. 2025): the layer should reproduce the full-precision model's output
  W·X_fp, not W·X with its own (already quantization-distorted) inputs X. The least-squares weights
  for that target are W + W·C·H⁻¹ with C = 2/N Σ (x_fp - x) xᵀ; minimising ‖(Q - W*)X‖ is the same
  problem up to a constant, so GPTQ runs unchanged on W* = W + α·W·C·H⁻¹ (α = `fp_target`; the
  paper uses 0.25 in its sequential form).
- Any grid (grids/__init__.py): parameters are chosen for one span of columns when it starts (a
  group of the integer grid, a GGUF (super-)block), from the error-updated weights, and columns
  are rounded against them; a GGUF block's search sees its columns in their stored order and the
  Hessian's diagonal as its importance vector (what llama.cpp's imatrix measures). GGUF stores no
  g_idx, so act-order onto a GGUF grid needs static groups (or the group-aware order).
- `refit_scales` (ours, integer grid only): once the codes are fixed, each row's group scales are
  re-solved by least squares on the same objective GPTQ minimises, (w - ŵ) H (w - ŵ)ᵀ with
  ŵ_j = s_g (q_j - z_g), which is linear in the scales. The min/max (or clipped) scales chosen before the column updates are
  rarely the best ones for the codes GPTQ ends up with.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from llmopt.calibration.hessian import HessianAccumulator
from llmopt.errors import OptionError
from llmopt.quant.grids import Grid, IntGrid
from llmopt.quant.grids.integer import IntParams, OnIntGrid
from llmopt.quant.method import Collector, Quantized
from llmopt.options import QuantizeOptions
from llmopt.quantized_tensor import QuantizedTensor

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GPTQConfig(OnIntGrid):
    name: ClassVar[str] = "gptq"
    bits: int = QuantizeOptions.bits
    group_size: int = QuantizeOptions.group_size  # > 0 per group, -1 per output channel
    sym: bool = True
    act_order: bool = QuantizeOptions.act_order
    static_groups: bool = QuantizeOptions.static_groups
    damp: float = QuantizeOptions.damp  # fraction of the mean Hessian diagonal added to the diagonal
    damp_step: float = QuantizeOptions.damp_step  # added to `damp` each time Cholesky fails
    block_size: int = 128
    mse: bool = QuantizeOptions.mse  # clipping search when choosing group parameters
    mse_weighted: bool = True  # weight the clipping search's column errors by diag H (activation energy)
    refit_scales: bool = QuantizeOptions.refit_scales  # re-solve the scales for the final codes (least squares, see above)
    fp_target: float = QuantizeOptions.gptaq  # GPTAQ's α: > 0 pulls the layer toward the full-precision model's output
    group_aware: bool = False  # act-order within contiguous groups (see above)
    zero_min: int = 0  # 1 for GPTQ v1 checkpoints (see grids/integer.py)
    sym_scale: str = "gptq"  # the symmetric grid's scale (grids/integer.py, SYM_SCALES)

    def build(self) -> GPTQ:
        return GPTQ(self)


@dataclass
class GPTQResult:
    tensor: QuantizedTensor
    row_loss: torch.Tensor  # [out] the paper's objective per output row: Σ (w - q)² / [H⁻¹]ᵢᵢ / 2
    damp: float  # the damping that made Cholesky succeed

    @property
    def loss(self) -> float:
        return float(self.row_loss.sum())


class GPTQ:
    """The method: one Hessian per stage; linears that share it and a grid are quantized stacked,
    since GPTQ treats rows independently (one solve instead of several)."""

    name = "gptq"
    calibrated = True
    stage_statistics = True

    def __init__(self, config: GPTQConfig):
        self.config = config
        self.full_precision_inputs = config.fp_target > 0

    def collector(self, features: int, device: torch.device) -> Collector | None:
        return HessianAccumulator(features, device, self.full_precision_inputs)

    def quantize_stage(self, weights: dict[str, torch.Tensor], grids: dict[str, Grid],
                       stats: Collector | None) -> dict[str, Quantized]:
        assert isinstance(stats, HessianAccumulator)
        out: dict[str, Quantized] = {}
        by_grid: dict[Any, list[str]] = {}
        for name in weights:
            by_grid.setdefault(grids[name], []).append(name)
        for grid, names in by_grid.items():
            parts = [weights[n] for n in names]
            stacked = torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]
            label = names[0] if len(names) == 1 else names[0].rpartition(".")[0] + "." + "+".join(
                n.rpartition(".")[2] for n in names)  # for messages: model.layers.0.self_attn.q_proj+k_proj+v_proj
            r = gptq_quantize(stacked, stats.value(), self.config, label, stats.cross, grid)
            row = 0
            for name, w in zip(names, parts):
                rows = slice(row, row + w.shape[0])
                row += w.shape[0]
                details = {"gptq_loss": float(r.row_loss[rows].sum()), "damp": r.damp}
                out[name] = Quantized(r.tensor.take_rows(rows) if len(names) > 1 else r.tensor, details)
        return out

    def provenance(self) -> dict[str, Any]:
        c = self.config
        return {"damp": c.damp, "act_order": c.act_order, "group_aware_order": c.group_aware,
                "static_groups": c.static_groups, "mse": c.mse, "refit_scales": c.refit_scales, "gptaq": c.fp_target}


def inverse_hessian_factor(h: torch.Tensor, damp: float, damp_step: float, name: str = "") -> tuple[torch.Tensor, float]:
    """Upper Cholesky factor of (H + λI)⁻¹ with λ = damp·mean(diag H), raising damp until it exists."""
    while True:  # each [in, in] factor dropped once the next exists: two alive beside h, not four
        lower, info = torch.linalg.cholesky_ex(damped(h, damp))
        if int(info) == 0:
            inv = torch.cholesky_inverse(lower)
            del lower
            upper, info = torch.linalg.cholesky_ex(inv, upper=True)
            del inv
            if int(info) == 0:
                return upper, damp
        if damp >= 1.0:
            raise ValueError(f"{name}: the Hessian is not positive definite even with damp {damp:.2f}")
        log.warning("%s: Cholesky failed with damp %.3f; retrying with %.3f", name or "layer", damp, damp + damp_step)
        damp = damp + damp_step


def damped(h: torch.Tensor, damp: float) -> torch.Tensor:
    """H + λI with λ = damp · mean(diag H) (a copy with λ added to its diagonal: no [in, in] identity)."""
    out = h.clone()
    out.diagonal().add_(damp * float(torch.diag(h).mean()))
    return out


def check_grid(cfg: GPTQConfig, grid: Grid) -> None:
    """Refuse the options a grid cannot hold, before any work."""
    if isinstance(grid, IntGrid):
        return
    if cfg.act_order and not cfg.static_groups:
        raise OptionError(f"<act_order> onto {grid.name} needs <static_groups>: GGUF stores no column permutation (g_idx)")
    if cfg.refit_scales:
        raise OptionError(f"<refit_scales> applies to the integer grid of GPTQ checkpoints, not {grid.name}")


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, cfg: GPTQConfig, name: str = "",
                  cross: torch.Tensor | None = None, grid: Grid | None = None) -> GPTQResult:
    """Quantize `weight` [out, in] onto `grid` (the config's integer grid by default) given the input
    Hessian [in, in] (float32, any scale) and, for `fp_target`, GPTAQ's cross term 2/N Σ (x_fp - x) xᵀ
    on the same scale."""
    grid = cfg.grid() if grid is None else grid
    check_grid(cfg, grid)
    integer = isinstance(grid, IntGrid)
    w = weight.to(device=hessian.device, dtype=torch.float32).clone()
    h = hessian.to(torch.float32).clone()
    rows, cols = w.shape
    gs = grid.span(cols)
    n_groups = -(-cols // gs)

    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    if cfg.fp_target > 0 and cross is not None:
        c = cross.to(device=w.device, dtype=torch.float32).clone()
        c[:, dead] = 0
        w = w + cfg.fp_target * (w @ torch.linalg.solve(damped(h, cfg.damp), c.t()).t())  # W + α W C H⁻¹ (H symmetric)
        w[:, dead] = 0
    target, h_orig = (w.clone(), h.clone()) if cfg.refit_scales else (None, None)
    # What a span's parameter search weighs its columns by: the integer grid's clipping search takes
    # diag H when weighted; a GGUF block's search takes it as its importance vector (imatrix).
    weigh = cfg.mse and cfg.mse_weighted if integer else True
    stored_energy = torch.diag(h).clone()  # each input column's, in stored order

    def span_energy(g: int) -> torch.Tensor | None:
        return stored_energy[g * gs: (g + 1) * gs] if weigh else None

    params: list[Any] = [None] * n_groups
    static = cfg.static_groups or cfg.group_size <= 0 and integer
    if static:
        for g in range(n_groups):
            params[g] = grid.choose(w[:, g * gs: (g + 1) * gs], span_energy(g))

    perm = torch.argsort(torch.diag(h), descending=True) if cfg.act_order else None
    group_aware = cfg.group_aware and not static and not cfg.act_order
    if group_aware:
        perm = group_aware_order(torch.diag(h), gs)
    if perm is not None:
        w = w[:, perm]
        h = h[perm][:, perm]
    hinv, damp = inverse_hessian_factor(h, cfg.damp, cfg.damp_step, name)
    energy = torch.diag(h).clone()  # each column's, in processing order
    del h  # the column loop reads only H⁻¹'s factor (and refit_scales its own copy)

    code_dtype = torch.uint8 if grid.bits <= 8 else torch.int32  # FP8's codes are 19-bit (grids/fp8.py)
    codes = torch.zeros(rows, cols, dtype=code_dtype, device=w.device)
    # group of each processed (possibly permuted) column
    if perm is not None and (static or group_aware):
        col_group = perm // gs
    else:
        col_group = torch.arange(cols, device=w.device) // gs
    col_group_cpu = col_group.tolist()
    stored = perm.tolist() if perm is not None else range(cols)  # each processed column's stored index
    loss = torch.zeros(rows, dtype=torch.float32, device=w.device)

    p = None
    for b0 in range(0, cols, cfg.block_size):
        b1 = min(b0 + cfg.block_size, cols)
        w_blk = w[:, b0:b1].clone()
        err_blk = torch.zeros_like(w_blk)
        hinv_blk = hinv[b0:b1, b0:b1]
        for i in range(b1 - b0):
            c = b0 + i
            g = col_group_cpu[c]
            if static:
                p = params[g]
            elif c == 0 or g != col_group_cpu[c - 1]:  # a span starts: its parameters from the current weights
                end = c + min((g + 1) * gs, cols) - g * gs  # c plus the span's width
                current = w_blk[:, i:] if end <= b1 else torch.cat([w_blk[:, i:], w[:, b1:end]], dim=1)
                current = current[:, : end - c]
                if integer:  # columns in processing order, as GPTQ's reference code weighs them
                    p = grid.choose(current, energy[c:end] if weigh else None)
                else:  # a GGUF block's sub-blocks are positional: search it in stored order
                    if perm is not None:
                        current = current[:, torch.argsort(perm[c:end])]
                    p = grid.choose(current, span_energy(g))
                params[g] = p
            col = w_blk[:, i]
            j = stored[c] - g * gs  # the column's place in its span
            q = grid.round(col, p, j)
            codes[:, c] = q.to(code_dtype)
            d = hinv_blk[i, i]
            e = (col - grid.value(q, p, j)) / d
            loss += e.pow(2) / 2  # (w - q)^2 / d^2 / 2, the paper's per-column loss
            w_blk[:, i:] -= e.unsqueeze(1) * hinv_blk[i, i:].unsqueeze(0)
            err_blk[:, i] = e
        w[:, b1:] -= err_blk @ hinv[b0:b1, b1:]

    g_idx = None
    if perm is not None:
        inv = torch.argsort(perm)
        codes = codes[:, inv]
        if not static and not group_aware:
            g_idx = col_group[inv].to(torch.int32)  # groups were formed in processing order
    if target is not None:
        groups = g_idx.long() if g_idx is not None else torch.arange(cols, device=w.device) // gs
        scales = torch.stack([q.scale for q in params], dim=1)
        zeros = torch.stack([q.zero for q in params], dim=1)
        scales = refit_scales(target, codes, zeros, groups, scales, damped(h_orig, damp))
        params = [IntParams(scales[:, g], zeros[:, g]) for g in range(n_groups)]
    return GPTQResult(grid.assemble_spans(codes, params, g_idx), loss.cpu(), damp)


def group_aware_order(energy: torch.Tensor, gs: int) -> torch.Tensor:
    """Column order for `group_aware`: groups by decreasing max energy, columns by decreasing energy
    inside each group (so each group's columns stay together)."""
    cols = energy.shape[0]
    group = torch.arange(cols, device=energy.device) // gs
    n_groups = int(group[-1]) + 1
    peak = torch.full((n_groups,), -float("inf"), device=energy.device).scatter_reduce(0, group, energy, "amax")
    rank = torch.empty_like(group)
    rank[torch.argsort(peak, descending=True)] = torch.arange(n_groups, device=energy.device)
    # sort key: group rank first, then energy descending within the group
    inner = torch.argsort(torch.argsort(energy, descending=True))  # 0 = most energetic column overall
    return torch.argsort(rank[group] * cols + inner)


def refit_scales(w: torch.Tensor, codes: torch.Tensor, zeros: torch.Tensor, groups: torch.Tensor,
                 scales: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """Per row, the group scales s minimising (w - ŵ) H (w - ŵ)ᵀ, ŵ_j = s_g(j) · (q_j - z_g(j)).

    The normal equations are A s = b with A[g, g'] = Σ_{j∈g, k∈g'} d_j H_jk d_k and
    b[g] = Σ_{j∈g} d_j (H w)_j, where d = q - z; solved for all rows at once. Groups whose codes
    all sit on the zero point (d = 0) keep their scale; results are stored as float16 like the rest.
    """
    rows, cols = w.shape
    n_groups = scales.shape[1]
    member = torch.nn.functional.one_hot(groups, n_groups).to(w.dtype)  # [cols, G]
    d = codes.to(w.dtype) - zeros[:, groups]  # [rows, cols]
    a = torch.empty(rows, n_groups, n_groups, dtype=w.dtype, device=w.device)
    for g in range(n_groups):
        cols_g = groups == g
        hd = d[:, cols_g] @ h[cols_g]  # [rows, cols]: (H diag(d) 1_g) per row
        a[:, :, g] = (d * hd) @ member
    b = (d * (w @ h)) @ member  # [rows, G]
    empty = torch.diagonal(a, dim1=1, dim2=2) <= 0
    eye = torch.eye(n_groups, dtype=w.dtype, device=w.device)
    a = torch.where(empty.unsqueeze(1) | empty.unsqueeze(2), eye * empty.unsqueeze(2), a)  # decouple empty groups
    b = torch.where(empty, scales, b)
    solved = torch.linalg.solve(a + 1e-9 * eye * torch.diagonal(a, dim1=1, dim2=2).mean(-1, keepdim=True).unsqueeze(-1), b)
    ok = torch.isfinite(solved) & (solved > 0)
    solved = torch.where(ok, solved, scales).to(torch.float16).to(torch.float32)
    return torch.where(solved > 0, solved, scales)
