"""IQ3_XXS and IQ2_XXS: groups of magnitudes rounded onto a lattice codebook, signs stored apart.

    IQ3_XXS: 256-element super-blocks, fp16 d; per 32: 8 indices of 4-value points, 4×7 sign bits,
             a 4-bit scale l (98 bytes / 256, 3.06 bpw): w = d·(0.5 + l)·0.5 · grid·sign
    IQ2_XXS: the same with 4 indices of 8-value points (66 bytes / 256, 2.06 bpw), w = d·(0.5 + l)·0.25 · grid·sign

Eight signs are stored as seven: the eighth makes the count of negatives even, so before rounding
llama.cpp flips the sign of the least important value of a group with an odd count. Then, per
32-sub-block (quantize_row_iq3_xxs_impl / quantize_row_iq2_xxs_impl in ggml-quants.c), it tries
31 (IQ3) or 13 (IQ2) inverse scales; each rounds every coordinate to its nearest level, takes the
lattice point of each group (`lattice.Lattice`: the point itself, or the best of its neighbours
under the weighted error) and wins when its Σwqx² / Σwq² beats the best so far; groups that were
off the lattice (IQ3) or all groups (IQ2) are rounded once more against the winning scale, which is
refitted. IQ2's trials centre on make_qp_quants' scale. The super-block's d = max scale / 31 (IQ3
stores it ×1.0125) and l rounds each scale to d·(2l + 1)/2. Weights are x² or imatrix·sqrt(σ² + x²),
σ² = Σx²/256 (IQ3: twice that); IQ2_XXS needs the imatrix, as in llama.cpp.

The trials and the re-rounding are one compiled pass over tiles of sub-blocks (`compiled.lattice_search`),
the rest torch ops over the sub-blocks of a chunk of rows, all in llama.cpp's float32 operation order. Codes in the QuantizedTensor are the read-back values ±grid + 128 (`bits` 8, symmetric) and
scales d·(0.5 + l)·0.5 (0.25), so (code - 128)·scale is exactly gguf's dequantization; the packer
finds each group's point and sign bits from the codes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from llmopt.errors import InputError
from llmopt.quant.grids.codebooks import (
    IQ2_LEVELS,
    IQ2_S_KGRID,
    IQ2_XS_KGRID,
    IQ2_XXS_KGRID,
    IQ3_S_KGRID,
    IQ3_S_LEVELS,
    IQ3_XXS_KGRID,
    IQ3_XXS_LEVELS,
)
from llmopt.quant.grids.lattice import Lattice
from llmopt.quant.grids.layout import QK_K, BlockGrid, BlockParams, importance_major, per_block, superblock_sum_x2, to_rows
from llmopt.quant.grids.numerics import blocks_major, c_float, c_sqrt, c_step, nearest_int_exact, positive_max, rdiv
from llmopt.quant.grids.searches import kernels, make_qp_quants
from llmopt.quantized_tensor import QuantizedTensor

SIGN_GROUP = 8  # signs are stored 7 per 8 values
CODE_OFFSET = 128  # codes are ±value + 128

IQ3_XXS_LATTICE = Lattice(IQ3_XXS_KGRID, dims=4, bits=3, nwant=2, levels=IQ3_XXS_LEVELS)
IQ2_XXS_LATTICE = Lattice(IQ2_XXS_KGRID, dims=8, bits=2, nwant=2, levels=IQ2_LEVELS)
IQ2_XS_LATTICE = Lattice(IQ2_XS_KGRID, dims=8, bits=2, nwant=2, levels=IQ2_LEVELS)
IQ3_S_LATTICE = Lattice(IQ3_S_KGRID, dims=4, bits=3, nwant=3, levels=IQ3_S_LEVELS)
IQ2_S_LATTICE = Lattice(IQ2_S_KGRID, dims=8, bits=2, nwant=1, levels=IQ2_LEVELS)


def imatrix_required(type_name: str, tensor: str | None = None) -> InputError:
    where = f" for {tensor}" if tensor else ""
    return InputError(f"{type_name} needs an importance matrix{where} (--imatrix): llama.cpp refuses to quantize it without one")


def sign_bits(x: torch.Tensor, weight: torch.Tensor, parity: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """|x| and the sign bits of every 8 values: x, weight [n, S] -> (xval [n, S], signs [n/8, S] int64).
    `parity` (7 bits stored): the least important value of each group with an odd count of negatives
    is negated in xval, and its bit toggled."""
    xval = torch.where(x >= 0, x, -x)  # C keeps -0 as it is (-0 >= 0)
    neg = (x < 0).reshape(-1, SIGN_GROUP, x.shape[1])  # [n/8, 8, S]
    bit = (1 << torch.arange(SIGN_GROUP, dtype=torch.int64))[None, :, None]
    s = (neg.to(torch.int64) * bit).sum(dim=1)
    if not parity:
        return xval, s
    odd = neg.sum(dim=1) % 2 == 1
    if bool(odd.any()):
        imin = (weight * x * x).reshape(neg.shape).argmin(dim=1)  # the first least w·x² of the group
        flip = torch.zeros(neg.shape, dtype=torch.bool).scatter_(1, imin[:, None], odd[:, None])
        xval = torch.where(flip.reshape(x.shape), -xval, xval)
        s = s ^ torch.where(odd, 1 << imin, 0)
    return xval, s & 127


def stored_sign_mask(signs: torch.Tensor, parity: bool) -> torch.Tensor:
    """The 8 signs the reader gets from the stored bits, bool [..., 8]; `parity`: 7 stored, the 8th
    evens the count (ksigns_iq2xs)."""
    if not parity:
        return ((signs[..., None] >> torch.arange(8)) & 1).bool()
    bits = (signs[..., None] >> torch.arange(7)) & 1
    return torch.cat([bits, bits.sum(dim=-1, keepdim=True) % 2], dim=-1).bool()


def shift_slots(index: torch.Tensor, signs: torch.Tensor, kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """IQ3_S as llama.cpp writes it: the low 8 bits of the points and the sign bytes of each kept
    sub-block go to the next free slot of the super-block (a skipped one does not advance the write
    position), while the 9th bits stay at their own sub-block. index [groups, S], signs [signs, S],
    kept [super-blocks, 8] -> what a reader decodes at every position."""
    n_sb, n_sub = kept.shape
    slot_source = torch.sort((~kept).to(torch.uint8), dim=1, stable=True).indices  # kept sub-blocks first, in order
    filled = torch.arange(n_sub)[None, :] < kept.sum(dim=1, keepdim=True)

    def moved(t: torch.Tensor) -> torch.Tensor:
        per_sb = t.t().reshape(n_sb, n_sub, -1)  # [super-blocks, sub-blocks, k]
        got = per_sb.gather(1, slot_source[:, :, None].expand_as(per_sb))
        return torch.where(filled[:, :, None], got, 0).reshape(-1, t.shape[0]).t()

    return moved(index & 255) | (index >> 8 << 8), moved(signs)


class GroupSearchGrid(BlockGrid):
    """A grid whose codes are chosen a group of values at a time (the lattice i-quants, IQ1), with codes
    ±value + 128 and w = scale·(code - 128).

    Error feedback: a group cannot be rounded one column at a time, so within a block the codes are
    those of the block's own search (`choose`, on the weights as they stand when the block starts);
    the error of each column still feeds the blocks after it."""

    needs_imatrix: bool  # llama.cpp's quantizer asserts there is an importance matrix

    def require(self, importance: torch.Tensor | None) -> None:
        if importance is None and self.needs_imatrix:
            raise imatrix_required(self.name)

    def quantize(self, weight: torch.Tensor, importance: torch.Tensor | None = None) -> QuantizedTensor:
        self.require(importance)
        return super().quantize(weight, importance)

    def choose(self, w: torch.Tensor, importance: torch.Tensor | None = None) -> BlockParams:
        fields = self.search_fields(w, importance)
        qt = self.assemble(fields)
        kept = {k: v for k, v in fields.items() if k != "codes"} | {"chosen": fields["codes"]}
        return BlockParams(kept, qt.scales, -float(CODE_OFFSET) * qt.scales, qt.group_size)

    def round(self, x: torch.Tensor, p: BlockParams, j: int) -> torch.Tensor:
        return p.fields["chosen"][:, j].to(torch.float32)

    def value(self, q: torch.Tensor, p: BlockParams, j: int) -> torch.Tensor:
        return p.scale[:, j // p.sub] * (q - CODE_OFFSET)


@dataclass(frozen=True)
class LatticeGrid(GroupSearchGrid):
    """IQ3_XXS or IQ2_XXS (see the module docstring for what differs)."""

    name: str
    lattice: Lattice
    sub: int  # elements per 4-bit scale
    trials: int  # inverse scales tried: is = -trials..trials
    trial_step: float
    eps: float  # a sub-block whose largest magnitude is below this is stored as zeros (0: only all-zero ones)
    sigma_factor: float  # σ² = sigma_factor·Σx²/256
    d_fudge: float  # the stored d is d·d_fudge
    read_factor: float  # the reader's scale is d·(0.5 + l)·read_factor (0: d·(1 + 2l), IQ3_S)
    needs_imatrix: bool
    parity: bool = True  # 7 sign bits per 8 values (the _XXS/_XS types), else 8
    qp_centre: bool = False  # trials centre on make_qp_quants' scale (IQ2_XXS)
    requant: str = "off"  # after the trials re-round: "off" the off-lattice groups, "all" every group (IQ2_XXS),
    #                       "all_if_off" every group when any is off-lattice (IQ3_S, whose groups start as off)
    sigma_without_imatrix: float = 0.0  # weights without an imatrix: this·σ² + x² (IQ2_S: 0.25)
    zero_dead: bool = True  # a super-block whose scales are all 0 is stored as zeros (else its points stay)
    shifted_slots: bool = False  # IQ3_S: each skipped sub-block moves later ones' points and signs down a slot
    block: int = QK_K
    bits: int = 8

    @property
    def nmax(self) -> int:
        return self.lattice.nlevels

    def chunk(self, w: torch.Tensor, importance: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        self.require(importance)
        rows = w.shape[0]
        x = blocks_major(w, self.sub)  # [sub, S]
        if importance is not None or self.sigma_without_imatrix:
            sigma2 = per_block(superblock_sum_x2(w) * (self.sigma_factor / QK_K), QK_K // self.sub)
        if importance is not None:
            weight = importance_major(importance, rows, self.sub) * c_sqrt(sigma2 + x * x)
        elif self.sigma_without_imatrix:
            weight = sigma2 * c_float(self.sigma_without_imatrix) + x * x
        else:
            weight = x * x
        waux = c_sqrt(weight)
        xval, signs = sign_bits(x, weight, self.parity)
        scale, L, active, signs = self._sub_block_search(xval, weight, waux, signs)
        return self._fields(scale, L, active, signs, rows)

    def _sub_block_search(self, xval: torch.Tensor, weight: torch.Tensor, waux: torch.Tensor,
                          signs: torch.Tensor) -> tuple[torch.Tensor, ...]:  # fmt: skip
        mx = xval.amax(dim=0)
        active = mx >= c_float(self.eps) if self.eps else mx > 0  # C: `max < eps` or `!max` skips
        if not self.qp_centre:  # trials around (2·nmax - 1)/max, starting from scale max/(2·nmax - 1)
            base, top = mx, 2 * self.nmax - 1
            scale = mx / torch.full_like(mx, float(top))
        else:  # IQ2_XXS: trials around make_qp_quants' scale
            qp_scale, _ = make_qp_quants(xval, self.nmax + 1, weight, wrap=True)
            base, top = qp_scale * float(self.nmax), 2 * self.nmax - 1
            active &= base > 0
            scale = qp_scale
        base = torch.where(active, base, torch.ones_like(base))
        scale, L = self._search(xval, weight, waux, base, scale, active, top)
        flipped = scale < 0  # "should never happen" in llama.cpp: positive scale, every sign flipped
        scale = torch.where(flipped, -scale, scale)
        signs = torch.where(flipped, ~signs & (127 if self.parity else 255), signs)
        return torch.where(active, scale, torch.zeros_like(scale)), L, active, signs

    def _search(self, xval: torch.Tensor, weight: torch.Tensor, waux: torch.Tensor, base: torch.Tensor,
                scale: torch.Tensor, active: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The trials and the re-rounding in one compiled pass over the sub-blocks (compiled.lattice_search)."""
        lat = self.lattice
        numerators = np.array([c_step(top, self.trial_step, k) for k in range(-self.trials, self.trials + 1)], np.float32)
        scale_out, levels = torch.empty(xval.shape[1]), torch.empty(xval.shape[1], xval.shape[0])
        rows = [t.t().contiguous().numpy() for t in (xval, weight, waux)]
        kernels().lattice_search(*rows, base.contiguous().numpy(), scale.contiguous().numpy(), active.numpy(),
                                 numerators, ("off", "all", "all_if_off").index(self.requant), self.nmax, lat.dims,
                                 lat.bits, *lat.compact_map, lat.coords, scale_out.numpy(), levels.numpy())  # fmt: skip
        return scale_out, levels.t()

    def _fields(self, scale: torch.Tensor, L: torch.Tensor, active: torch.Tensor, signs: torch.Tensor,
                rows: int) -> dict[str, torch.Tensor]:  # fmt: skip
        lat, n_sub = self.lattice, QK_K // self.sub
        max_scale = positive_max(scale.reshape(-1, n_sub), dim=1)
        live = max_scale > 0
        d = max_scale / torch.full_like(max_scale, 31.0)
        inv = rdiv(1.0, torch.where(live, d, torch.ones_like(d)))
        sc = nearest_int_exact((per_block(inv, n_sub) * scale - 1.0) * 0.5).clamp_(0, 15)
        keep = active & per_block(live, n_sub) if self.zero_dead else active  # sub-blocks whose points and signs are stored
        sc = torch.where(per_block(live, n_sub), sc, torch.zeros_like(sc))
        d_stored = torch.where(live, d * torch.tensor(self.d_fudge) if self.d_fudge != 1.0 else d, torch.zeros_like(d))
        grouped = L.reshape(-1, lat.dims, L.shape[1]).permute(0, 2, 1)
        index = torch.where(keep, lat.index_of_key[lat.key(grouped)], 0)
        if bool((index < 0).any()):
            raise AssertionError(f"{self.name}: a rounded group is not a lattice point")
        signs = torch.where(keep, signs, 0)
        if self.shifted_slots:
            index, signs = shift_slots(index, signs, keep.reshape(-1, n_sub))
        values = lat.read_values[index]  # [groups, S, dims]
        negative = stored_sign_mask(signs.t(), self.parity)  # [S, sub/8, 8]
        values = values.permute(1, 0, 2).reshape(-1, self.sub)  # [S, sub] in element order
        codes = torch.where(negative.reshape(-1, self.sub), -values, values) + CODE_OFFSET
        return {
            "codes": codes.reshape(rows, -1).to(torch.uint8),
            "d": d_stored.to(torch.float16).reshape(rows, -1),
            "sc": to_rows(sc[None], rows).to(torch.uint8),
        }

    def assemble(self, out: dict[str, torch.Tensor]) -> QuantizedTensor:
        d = out["d"].to(torch.float32).repeat_interleave(QK_K // self.sub, dim=1)
        sc = out["sc"].to(torch.float32)
        scales = d * (sc * 2.0 + 1.0) if not self.read_factor else d * (sc + 0.5) * self.read_factor
        aux = {"d": out["d"], "sc": out["sc"]}
        return QuantizedTensor(codes=out["codes"], scales=scales, bits=8, group_size=self.sub, grid=self.name, aux=aux)


IQ3_XXS = LatticeGrid("IQ3_XXS", IQ3_XXS_LATTICE, sub=32, trials=15, trial_step=0.2, eps=1e-8, sigma_factor=2.0,
                      d_fudge=1.0125, read_factor=0.5, needs_imatrix=False)  # fmt: skip
IQ2_XXS = LatticeGrid("IQ2_XXS", IQ2_XXS_LATTICE, sub=32, trials=6, trial_step=0.1, eps=1e-15, sigma_factor=1.0,
                      d_fudge=1.0, read_factor=0.25, needs_imatrix=True, qp_centre=True, requant="all")  # fmt: skip
IQ2_XS = LatticeGrid("IQ2_XS", IQ2_XS_LATTICE, sub=16, trials=9, trial_step=0.1, eps=1e-15, sigma_factor=1.0,
                     d_fudge=1.0, read_factor=0.25, needs_imatrix=True)  # fmt: skip
IQ3_S = LatticeGrid("IQ3_S", IQ3_S_LATTICE, sub=32, trials=9, trial_step=0.2, eps=0.0, sigma_factor=2.0,
                    d_fudge=1.033, read_factor=0.0, needs_imatrix=False, parity=False, requant="all_if_off",
                    zero_dead=False, shifted_slots=True)  # fmt: skip
IQ2_S = LatticeGrid("IQ2_S", IQ2_S_LATTICE, sub=16, trials=9, trial_step=0.1, eps=1e-8, sigma_factor=2.0,
                    d_fudge=0.9875, read_factor=0.25, needs_imatrix=False, parity=False, sigma_without_imatrix=0.25,
                    zero_dead=False)  # fmt: skip
