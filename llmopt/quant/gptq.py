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
- `refit_scales` (ours): once the codes are fixed, each row's group scales are re-solved by least
  squares on the same objective GPTQ minimises, (w - ŵ) H (w - ŵ)ᵀ with ŵ_j = s_g (q_j - z_g), which
  is linear in the scales. The min/max (or clipped) scales chosen before the column updates are
  rarely the best ones for the codes GPTQ ends up with.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from llmopt.quant.int_grid import IntGrid, group_count
from llmopt.quant.tensor import QuantizedTensor

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GPTQConfig:
    bits: int = 4
    group_size: int = 128  # > 0 per group, -1 per output channel
    sym: bool = True
    act_order: bool = False
    static_groups: bool = False
    damp: float = 0.01  # fraction of the mean Hessian diagonal added to the diagonal
    damp_step: float = 0.01  # added to `damp` each time Cholesky fails
    block_size: int = 128
    mse: bool = False  # clipping search when choosing group parameters
    mse_weighted: bool = True  # weight the clipping search's column errors by diag H (activation energy)
    refit_scales: bool = False  # re-solve the scales for the final codes (least squares, see above)
    fp_target: float = 0.0  # GPTAQ's α: > 0 pulls the layer toward the full-precision model's output
    group_aware: bool = False  # act-order within contiguous groups (see above)
    zero_min: int = 0  # 1 for GPTQ v1 checkpoints (see int_grid)

    def grid(self) -> IntGrid:
        return IntGrid(self.bits, self.sym, self.zero_min, self.mse)


@dataclass
class GPTQResult:
    tensor: QuantizedTensor
    row_loss: torch.Tensor  # [out] the paper's objective per output row: Σ (w - q)² / [H⁻¹]ᵢᵢ / 2
    damp: float  # the damping that made Cholesky succeed

    @property
    def loss(self) -> float:
        return float(self.row_loss.sum())


def inverse_hessian_factor(h: torch.Tensor, damp: float, damp_step: float, name: str = "") -> tuple[torch.Tensor, float]:
    """Upper Cholesky factor of (H + λI)⁻¹ with λ = damp·mean(diag H), raising damp until it exists."""
    while True:
        lower, info = torch.linalg.cholesky_ex(damped(h, damp))
        if int(info) == 0:
            inv = torch.cholesky_inverse(lower)
            upper, info = torch.linalg.cholesky_ex(inv, upper=True)
            if int(info) == 0:
                return upper, damp
        if damp >= 1.0:
            raise ValueError(f"{name}: the Hessian is not positive definite even with damp {damp:.2f}")
        log.warning("%s: Cholesky failed with damp %.3f; retrying with %.3f", name or "layer", damp, damp + damp_step)
        damp = damp + damp_step


def damped(h: torch.Tensor, damp: float) -> torch.Tensor:
    """H + λI with λ = damp · mean(diag H)."""
    return h + damp * float(torch.diag(h).mean()) * torch.eye(h.shape[0], dtype=h.dtype, device=h.device)


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, cfg: GPTQConfig, name: str = "",
                  cross: torch.Tensor | None = None) -> GPTQResult:
    """Quantize `weight` [out, in] given the input Hessian [in, in] (float32, any scale) and, for
    `fp_target`, GPTAQ's cross term 2/N Σ (x_fp - x) xᵀ on the same scale."""
    grid = cfg.grid()
    w = weight.to(device=hessian.device, dtype=torch.float32).clone()
    h = hessian.to(torch.float32).clone()
    rows, cols = w.shape
    gs = cols if cfg.group_size <= 0 else cfg.group_size
    n_groups = group_count(cols, cfg.group_size)

    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    if cfg.fp_target > 0 and cross is not None:
        c = cross.to(device=w.device, dtype=torch.float32).clone()
        c[:, dead] = 0
        w = w + cfg.fp_target * (w @ torch.linalg.solve(damped(h, cfg.damp), c.t()).t())  # W + α W C H⁻¹ (H symmetric)
        w[:, dead] = 0
    target, h_orig = (w.clone(), h.clone()) if cfg.refit_scales else (None, None)

    weigh = cfg.mse and cfg.mse_weighted  # the clipping search weighs columns by diag H
    static: tuple[torch.Tensor, torch.Tensor] | None = None
    if cfg.static_groups or cfg.group_size <= 0:
        static = _group_params(grid, w, gs, n_groups, torch.diag(h) if weigh else None)

    perm = torch.argsort(torch.diag(h), descending=True) if cfg.act_order else None
    group_aware = cfg.group_aware and static is None and not cfg.act_order
    if group_aware:
        perm = group_aware_order(torch.diag(h), gs)
    if perm is not None:
        w = w[:, perm]
        h = h[perm][:, perm]
    hinv, damp = inverse_hessian_factor(h, cfg.damp, cfg.damp_step, name)
    energy = torch.diag(h).clone() if weigh else None  # in processing order

    codes = torch.zeros(rows, cols, dtype=torch.uint8, device=w.device)
    scales = torch.zeros(rows, n_groups, dtype=torch.float32, device=w.device)
    zeros = torch.zeros(rows, n_groups, dtype=torch.float32, device=w.device)
    if static is not None:
        scales, zeros = static
    # group of each processed (possibly permuted) column
    if perm is not None and (static is not None or group_aware):
        col_group = perm // gs
    else:
        col_group = torch.arange(cols, device=w.device) // gs
    col_group_cpu = col_group.tolist()
    loss = torch.zeros(rows, dtype=torch.float32, device=w.device)

    scale = zero = None
    for b0 in range(0, cols, cfg.block_size):
        b1 = min(b0 + cfg.block_size, cols)
        w_blk = w[:, b0:b1].clone()
        err_blk = torch.zeros_like(w_blk)
        hinv_blk = hinv[b0:b1, b0:b1]
        for i in range(b1 - b0):
            c = b0 + i
            g = col_group_cpu[c]
            if static is None:
                if c == 0 or g != col_group_cpu[c - 1]:  # a group starts: its parameters from the current weights
                    end = c + min((g + 1) * gs, cols) - g * gs  # c plus the group's width
                    current = w_blk[:, i:] if end <= b1 else torch.cat([w_blk[:, i:], w[:, b1:end]], dim=1)
                    scale, zero = grid.params(current[:, : end - c], None if energy is None else energy[c:end])
                    scales[:, g], zeros[:, g] = scale, zero
            else:
                scale, zero = scales[:, g], zeros[:, g]
            col = w_blk[:, i]
            q = grid.quantize(col.unsqueeze(1), scale.unsqueeze(1), zero.unsqueeze(1)).squeeze(1)
            codes[:, c] = q.to(torch.uint8)
            d = hinv_blk[i, i]
            e = (col - (q - zero) * scale) / d
            loss += e.pow(2) / 2  # (w - q)^2 / d^2 / 2, the paper's per-column loss
            w_blk[:, i:] -= e.unsqueeze(1) * hinv_blk[i, i:].unsqueeze(0)
            err_blk[:, i] = e
        w[:, b1:] -= err_blk @ hinv[b0:b1, b1:]

    g_idx = None
    if perm is not None:
        inv = torch.argsort(perm)
        codes = codes[:, inv]
        if static is None and not group_aware:
            g_idx = col_group[inv].to(torch.int32)  # groups were formed in processing order
    if target is not None:
        groups = g_idx.long() if g_idx is not None else torch.arange(cols, device=w.device) // gs
        scales = refit_scales(target, codes, zeros, groups, scales, damped(h_orig, damp))
    qt = QuantizedTensor(codes=codes, scales=scales, bits=cfg.bits, group_size=cfg.group_size,
                         zeros=None if cfg.sym else zeros.to(torch.int32), g_idx=g_idx, grid="int")
    return GPTQResult(qt, loss.cpu(), damp)


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


def _group_params(grid: IntGrid, w: torch.Tensor, gs: int, n_groups: int,
                  energy: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape
    scales = torch.empty(rows, n_groups, dtype=torch.float32, device=w.device)
    zeros = torch.empty_like(scales)
    for g in range(n_groups):
        cols_g = slice(g * gs, (g + 1) * gs)
        scales[:, g], zeros[:, g] = grid.params(w[:, cols_g], None if energy is None else energy[cols_g])
    return scales, zeros
