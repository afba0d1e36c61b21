"""`QuantizedTensor`: the one format-neutral value every quantizer produces and every writer consumes.

A weight matrix W [out, in] is stored as integer codes on a grid plus per-group parameters:

    asymmetric, integer zero point (GPTQ, AWQ):   W[o, i] = (codes[o, i] - zeros[o, g]) * scales[o, g]
    asymmetric, float minimum (Q4_1, K-quants):   W[o, i] = codes[o, i] * scales[o, g] - mins[o, g]
    symmetric (Q4_0, Q8_0, GPTQ sym):             W[o, i] = (codes[o, i] - 2**(bits-1)) * scales[o, g]

where g = g_idx[i] (act-order permutes columns into groups) or i // group_size. `group_size` is
-1 for one group per output row (per-channel) and 0 for one scale for the whole tensor (per-tensor).
Algorithms never know about files; writers never know about Hessians.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class QuantizedTensor:
    codes: torch.Tensor  # [out, in], integer dtype, values in [0, 2**bits - 1]
    scales: torch.Tensor  # [out, n_groups] (or [1, 1] per-tensor), float
    bits: int
    group_size: int  # > 0 per-group, -1 per-channel, 0 per-tensor
    zeros: torch.Tensor | None = None  # [out, n_groups], integer-valued zero points
    mins: torch.Tensor | None = None  # [out, n_groups], float offsets (ggml's "m"/"dmin*m")
    g_idx: torch.Tensor | None = None  # [in] group of each input column, when not i // group_size
    grid: str | None = None  # the grid that produced the codes ("int", "Q4_K", ...), for writers
    aux: dict[str, torch.Tensor] = field(default_factory=dict)  # grid-specific encodings (e.g. 6-bit sub-scales)

    def __post_init__(self) -> None:
        if self.zeros is not None and self.mins is not None:
            raise ValueError("a QuantizedTensor has either integer zeros or float mins, not both")
        if self.codes.dim() != 2:
            raise ValueError(f"codes must be 2-D [out, in], got {tuple(self.codes.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.codes.shape[0]), int(self.codes.shape[1]))

    @property
    def symmetric(self) -> bool:
        return self.zeros is None and self.mins is None

    def group_index(self) -> torch.Tensor:
        """The group of every input column, [in] int64."""
        cols = self.shape[1]
        if self.g_idx is not None:
            return self.g_idx.to(torch.int64)
        if self.group_size <= 0:
            return torch.zeros(cols, dtype=torch.int64, device=self.codes.device)
        return torch.arange(cols, device=self.codes.device) // self.group_size

    def plain_groups(self) -> bool:
        """Whether the columns fall in groups of `group_size` in order (no act-order permutation; a g_idx that
        says so, as every GPTQ checkpoint stores one, counts as none)."""
        if self.group_size <= 0:
            return False
        plain = torch.arange(self.shape[1], device=self.codes.device) // self.group_size
        return self.g_idx is None or torch.equal(self.g_idx.to(torch.int64), plain)

    def _per_column(self, t: torch.Tensor) -> torch.Tensor:
        if t.shape[1] == 1:
            return t.expand(self.shape[0], 1) if t.shape[0] == 1 else t
        return t[:, self.group_index()]  # (contiguous groups never come here: `dequantize` broadcasts them)

    def take_rows(self, rows: torch.Tensor | slice) -> QuantizedTensor:
        """The output rows `rows` (a slice or an index tensor) as a QuantizedTensor of their own, every
        per-row field with them: codes, scales, zeros, mins and the grid's raw fields in `aux`.
        (Rows are independent in every grid: stacked linears split, Q/K rows permute for GGUF.)"""

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            if t.shape[0] == 1 and self.shape[0] != 1:  # one parameter row shared by all (per-tensor)
                return t
            return t[rows]

        return QuantizedTensor(
            codes=self.codes[rows], scales=pick(self.scales), bits=self.bits, group_size=self.group_size,
            zeros=pick(self.zeros), mins=pick(self.mins), g_idx=self.g_idx, grid=self.grid,
            aux={k: pick(v) for k, v in self.aux.items()},
        )  # fmt: skip

    @staticmethod
    def stack_rows(parts: list[QuantizedTensor]) -> QuantizedTensor:
        """Tensors over the same columns as one, rows in order: the inverse of `take_rows`. Files that
        store several linears as one (Phi-3's qkv_proj) need them on one grid and one column order,
        as linears quantized together on one shared input are."""
        first = parts[0]
        for p in parts[1:]:
            same = (p.bits, p.group_size, p.grid, p.shape[1], p.zeros is None, p.mins is None, set(p.aux)) == \
                (first.bits, first.group_size, first.grid, first.shape[1], first.zeros is None, first.mins is None, set(first.aux))  # fmt: skip
            if not same or not torch.equal(p.group_index(), first.group_index()):
                raise ValueError("linears stored as one need the same grid, bits, groups and column order")

        def cat(fields: list[torch.Tensor | None]) -> torch.Tensor | None:
            if fields[0] is None:
                return None
            rows = [t.expand(p.shape[0], *t.shape[1:]) if t.shape[0] == 1 and p.shape[0] != 1 else t
                    for t, p in zip(fields, parts)]  # a per-tensor parameter row repeats for each row
            return torch.cat(rows)

        return QuantizedTensor(
            codes=torch.cat([p.codes for p in parts]), scales=cat([p.scales for p in parts]), bits=first.bits,
            group_size=first.group_size, zeros=cat([p.zeros for p in parts]), mins=cat([p.mins for p in parts]),
            g_idx=first.g_idx, grid=first.grid, aux={k: cat([p.aux[k] for p in parts]) for k in first.aux},
        )  # fmt: skip

    def to(self, device: torch.device | str) -> QuantizedTensor:
        """The same tensor with every field on `device`."""

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return QuantizedTensor(self.codes.to(device), self.scales.to(device), self.bits, self.group_size,
                               move(self.zeros), move(self.mins), move(self.g_idx), self.grid,
                               {k: v.to(device) for k, v in self.aux.items()})  # fmt: skip

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The exact weights these codes stand for, computed in float32. Contiguous groups (a last partial one
        too) take their scales by broadcasting over views of the codes, not copied out per column: the same
        products, in place, in a third of the time (SmolLM2 GPTQ w4 g128's load)."""
        cols = self.shape[1]
        w = self.codes.to(torch.float32, copy=True)
        gs = self.group_size
        groups = -(-cols // gs) if gs > 0 else 0
        if groups > 1 and self.scales.shape[1] == groups and self.plain_groups():
            full = cols // gs
            spans = [(w[:, :full * gs].unflatten(1, (full, gs)), slice(0, full))]
            if cols % gs:
                spans.append((w[:, full * gs:].unsqueeze(1), slice(full, full + 1)))
            for part, groups in spans:
                self._scale_in_place(part, lambda t, g=groups: t[:, g].to(torch.float32).unsqueeze(-1))
        else:
            self._scale_in_place(w, lambda t: self._per_column(t.to(torch.float32)))
        return w.to(dtype)

    def _scale_in_place(self, q: torch.Tensor, per: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Codes `q` (float32) -> weights, each field broadcast to them by `per`."""
        s = per(self.scales)
        if self.mins is not None:
            q.mul_(s).sub_(per(self.mins))
        elif self.zeros is not None:
            q.sub_(per(self.zeros)).mul_(s)
        else:
            q.sub_(2 ** (self.bits - 1)).mul_(s)
