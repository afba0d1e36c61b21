"""IQ1_S and IQ1_M: groups of 8 values on a 2048-point codebook of levels -1, 0, 1, shifted by ±1/8.

    IQ1_S: 256-element super-blocks, fp16 d; per 32: 4 11-bit point indices, a 3-bit scale l and one
           shift sign (50 bytes / 256, 1.5625 bpw): w = d·(2l + 1)·(g ± 1/8), g in {-1, 0, 1}
    IQ1_M: per 16: 2 point indices and a 3-bit scale; one shift sign per 8; the fp16 d spread over the
           top nibbles of the four scale words (56 bytes / 256, 1.75 bpw)

llama.cpp's search (quantize_row_iq1_s_impl / quantize_row_iq1_m_impl in ggml-quants.c), per sub-block
of 32 (IQ1_S) or 16 (IQ1_M): weights imatrix·sqrt(σ² + x²), σ² = 2·Σx²/256 (IQ1_M without an imatrix:
x²); the values are sorted, and every split of the sorted order into three runs (levels 0, 1, 2) is
scored with every choice of shifts (IQ1_S: one per sub-block, IQ1_M: one per half) from prefix sums;
the first best (Σwqx)²/Σwq² wins. A group of 8 whose levels are not a codebook point takes the best of
its neighbours (`lattice.Lattice`, the points at the three smallest distances), and the scale is then
refitted. d = max scale / 15 and l rounds each scale to d·(2l + 1); IQ1_S stores d·1.125, IQ1_M refits
d over the whole super-block with the chosen l and stores it ·1.1125. IQ1_S needs the imatrix (llama.cpp
asserts), IQ1_M does not.

The split search is exhaustive: 561×2 (IQ1_S) or 153×4 (IQ1_M) candidates per sub-block, scanned in
llama.cpp's order with its float32 comparisons by numba kernels over tiles of sub-blocks
(`compiled.iq1_s_splits` / `iq1_m_splits`, and `neighbour_points` for the off-codebook groups).
Codes in the QuantizedTensor are 8·(g ± 1/8) + 128 (`bits` 8, symmetric) and scales d·(2l + 1)/8, so
(code - 128)·scale is exactly gguf's dequantization; the packer recovers each group's point and shift.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from llmopt.quant.grids.codebooks import IQ1_KGRID, IQ1_LEVELS
from llmopt.quant.grids.iq_lattice import CODE_OFFSET, GroupSearchGrid
from llmopt.quant.grids.lattice import Lattice
from llmopt.quant.grids.layout import QK_K, importance_major, per_block, superblock_sum_x2, to_rows
from llmopt.quant.grids.numerics import blocks_major, c_float, c_sqrt, nearest_int_exact, positive_max, rdiv, safe_div, seq_sum
from llmopt.quant.grids.searches import f32_array, kernels
from llmopt.quantized_tensor import QuantizedTensor

IQ1_LATTICE = Lattice(IQ1_KGRID, dims=8, bits=2, nwant=3, levels=IQ1_LEVELS)
GROUP = 8  # values per codebook point
SHIFT = 0.125  # IQ1S_DELTA = IQ1M_DELTA
UP = (-1 + SHIFT, SHIFT, 1 + SHIFT)  # what levels 0, 1, 2 stand for with shift +1/8 (llama.cpp's x_p)
DOWN = (-1 - SHIFT, -SHIFT, 1 - SHIFT)  # ... with shift -1/8 (x_m)
# IQ1_M's Σwq² terms as llama.cpp folds them: differences of squared level values, rounded to float32
SQUARE_STEPS = tuple(c_float(v[a] * v[a] - v[a + 1] * v[a + 1]) for v in (UP, DOWN) for a in (0, 1))  # cp1, cp2, cm1, cm2
CODE_STEP = 8  # codes are 8·(g ± 1/8) + 128: integers


@dataclass(frozen=True)
class IQ1Grid(GroupSearchGrid):
    """IQ1_S (`sub` 32, one shift per sub-block) or IQ1_M (`sub` 16, one shift per group of 8)."""

    name: str
    sub: int  # elements per 3-bit scale
    eps: float  # a sub-block whose largest magnitude is below this is stored as skipped
    needs_imatrix: bool
    d_fudge: float  # the stored d is d·d_fudge (IQ1_M: the refitted d)
    block: int = QK_K
    bits: int = 8

    @property
    def per_half(self) -> bool:
        return self.sub == 2 * GROUP  # IQ1_M: a shift per group (half a sub-block)

    def chunk(self, w: torch.Tensor, importance: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        self.require(importance)
        rows = w.shape[0]
        x = blocks_major(w, self.sub)  # [sub, S]
        if importance is not None:
            sigma2 = per_block(superblock_sum_x2(w) * (2.0 / QK_K), QK_K // self.sub)
            weight = importance_major(importance, rows, self.sub) * c_sqrt(sigma2 + x * x)
        else:
            weight = x * x
        active = x.abs().amax(dim=0) >= c_float(self.eps)
        order = torch.sort(x, dim=0, stable=True).indices  # C's qsort (glibc: a stable merge sort)
        ws, wxs = weight.gather(0, order), (weight * x).gather(0, order)
        chosen, found, scale = self._splits(ws, wxs, order)
        live = active & found
        scale = torch.where(live, scale, torch.zeros_like(scale))
        rank = torch.arange(self.sub)[:, None]
        L = torch.empty_like(order).scatter_(0, order, (rank >= chosen[:, 0]).long() + (rank >= chosen[:, 1]).long())
        shift = chosen[:, 2]
        flip = scale < 0
        L = torch.where(flip, 2 - L, L)
        scale = torch.where(flip, -scale, scale)
        shift = torch.where(flip, 3 - shift if self.per_half else -shift, shift)
        down = self._down(shift, live)  # [groups, S]: which groups use the -1/8 shift in the search
        levels, scale = self._points(x, weight, L, scale, down, live)
        return self._fields(weight, x, levels, scale, down, rows)

    def _splits(self, ws: torch.Tensor, wxs: torch.Tensor,
                order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """The best split of each sub-block's sorted order: (i1, i2, shift) [S, 3] (shift: IQ1_S ±1,
        IQ1_M the pair k; (0, 0, first) where none won), whether one won, and its scale: one compiled
        pass over tiles of sub-blocks."""
        n, count = ws.shape
        chosen, scale = torch.empty(count, 3, dtype=torch.int64), torch.empty(count)
        rows, rows_x, outs = f32_array(ws.t()), f32_array(wxs.t()), (chosen.numpy(), scale.numpy())
        if self.per_half:
            consts = np.array((UP[2], DOWN[2], *SQUARE_STEPS), np.float32)
            kernels().iq1_m_splits(rows, rows_x, (order >= n // 2).t().contiguous().numpy(), consts, *outs)
        else:
            kernels().iq1_s_splits(rows, rows_x, np.array((UP, DOWN), np.float32), *outs)
        found = chosen[:, 2] >= 0
        k = chosen[:, 2].clamp(min=0)
        chosen[:, 2] = k if self.per_half else 1 - 2 * k  # IQ1_S: k 0 is the +1/8 shift, 1 the -1/8
        return chosen, found, scale

    def _down(self, shift: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        """Per group of 8, whether the search used the -1/8 shift (skipped sub-blocks: +1/8)."""
        if self.per_half:
            down = torch.stack([shift >= 2, shift % 2 == 1])
        else:
            down = (shift == -1)[None].expand(self.sub // GROUP, -1)
        return down & live

    def _points(self, x: torch.Tensor, weight: torch.Tensor, L: torch.Tensor, scale: torch.Tensor, down: torch.Tensor,
                live: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The levels [sub, S] of each group's codebook point (the split's levels, or the best neighbour;
        point 0 in a skipped sub-block) and the scale refitted where a group was off the codebook."""
        lat, groups = IQ1_LATTICE, self.sub // GROUP
        grouped = L.reshape(groups, GROUP, -1).permute(0, 2, 1)  # [groups, S, 8]
        keys = lat.key(grouped)
        index = lat.index_of_key[keys]
        off = (index < 0) & live[None]
        values = torch.tensor([UP, DOWN])[down.long()]  # [groups, S, 3]
        if bool(off.any()):
            g, s = off.nonzero(as_tuple=True)
            xg = x.reshape(groups, GROUP, -1)
            wg = weight.reshape(groups, GROUP, -1)
            index[g, s] = lat.best_neighbour(keys[g, s], xg[g, :, s], wg[g, :, s], scale[s], values[g, s])
        index = torch.where(live[None], index, 0)
        levels = torch.from_numpy(lat.coords)[index]  # [groups, S, 8]
        refit = off.any(dim=0)
        if bool(refit.any()):
            q = values.gather(2, levels).permute(0, 2, 1).reshape(x.shape)  # [sub, S]
            wq = weight * q
            sumqx, sumq2 = seq_sum(wq * x).add_(0.0), seq_sum(wq * q).add_(0.0)
            better = refit & (sumqx > 0) & (sumq2 > 0)
            scale = torch.where(better, safe_div(sumqx, sumq2), scale)
        return levels.permute(0, 2, 1).reshape(x.shape), scale

    def _fields(self, weight: torch.Tensor, x: torch.Tensor, levels: torch.Tensor, scale: torch.Tensor, down: torch.Tensor,
                rows: int) -> dict[str, torch.Tensor]:  # fmt: skip
        n_sub = QK_K // self.sub
        max_scale = positive_max(scale.reshape(-1, n_sub), dim=1)
        stored = max_scale > 0  # else llama.cpp leaves d, the scales and the shift bits 0
        d = max_scale / torch.full_like(max_scale, 15.0)
        inv = rdiv(1.0, torch.where(stored, d, torch.ones_like(d)))
        sc = nearest_int_exact((per_block(inv, n_sub) * scale - 1.0) * 0.5).clamp_(0, 7)
        if self.per_half:
            d = self._refit_d(x, weight, levels, sc, down, d, rows)
        d_stored = torch.where(stored, d * c_float(self.d_fudge), torch.zeros_like(d))
        sc = torch.where(per_block(stored, n_sub), sc, torch.zeros_like(sc))
        negative = down & per_block(stored, n_sub)[None]  # [groups, S]
        sign = torch.where(negative, -1, 1).repeat_interleave(GROUP, dim=0)  # [sub, S]
        codes = (levels - 1) * CODE_STEP + sign + CODE_OFFSET
        return {
            "codes": to_rows(codes, rows).to(torch.uint8),
            "d": d_stored.to(torch.float16).reshape(rows, -1),
            "sc": to_rows(sc[None], rows).to(torch.uint8),
        }

    def _refit_d(self, x: torch.Tensor, weight: torch.Tensor, levels: torch.Tensor, sc: torch.Tensor, down: torch.Tensor,
                 d: torch.Tensor, rows: int) -> torch.Tensor:  # fmt: skip
        """IQ1_M: d = Σwqx/Σwq² over the super-block with q = the chosen level's value·(2l + 1) (when Σwq² > 0)."""
        values = torch.tensor([UP, DOWN])[down.long()]  # [groups, S, 3]
        groups = self.sub // GROUP
        q = values.gather(2, levels.reshape(groups, GROUP, -1).permute(0, 2, 1)).permute(0, 2, 1).reshape(levels.shape)
        q = q * (sc * 2.0 + 1.0)
        wq = weight * q
        in_order = [blocks_major(to_rows(t, rows), QK_K) for t in (wq * x, wq * q)]  # summed over the super-block
        sumqx, sumq2 = (seq_sum(t).add_(0.0) for t in in_order)
        return torch.where(sumq2 > 0, safe_div(sumqx, sumq2), d)

    def assemble(self, out: dict[str, torch.Tensor]) -> QuantizedTensor:
        n_sub = QK_K // self.sub
        d = out["d"].to(torch.float32).repeat_interleave(n_sub, dim=1)
        scales = d * (out["sc"].to(torch.float32) * 2.0 + 1.0) / CODE_STEP
        aux = {"d": out["d"], "sc": out["sc"]}
        return QuantizedTensor(codes=out["codes"], scales=scales, bits=8, group_size=self.sub, grid=self.name, aux=aux)


IQ1_S = IQ1Grid("IQ1_S", sub=32, eps=1e-12, needs_imatrix=True, d_fudge=1.125)
IQ1_M = IQ1Grid("IQ1_M", sub=16, eps=1e-7, needs_imatrix=False, d_fudge=1.1125)
