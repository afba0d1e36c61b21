"""Shared plumbing of the grids: block layouts, row chunking, importance weights, the grid base class."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import ClassVar

import torch

from llmopt.errors import InputError
from llmopt.quant.grids.numerics import blocks_major, seq_sum
from llmopt.quant.grids.searches import requantize_rows
from llmopt.quantized_tensor import QuantizedTensor

QK_K = 256  # elements per K-quant super-block
CHUNK_ELEMENTS = 1 << 18  # rows are quantized in chunks of about this many elements (a chunk's temporaries stay in cache)


def check_rows(w: torch.Tensor, block: int, type_name: str) -> torch.Tensor:
    """The weight as contiguous float32 [rows, cols], or an error if rows do not fill whole blocks."""
    if w.dim() != 2:
        raise InputError(f"{type_name} quantizes 2-D weights, got shape {tuple(w.shape)}")
    if w.shape[1] % block:
        raise InputError(f"{type_name} needs rows that are a multiple of {block}, got {w.shape[1]}")
    return w.detach().to(torch.float32).contiguous()


def on_cpu(t: torch.Tensor | None) -> torch.Tensor | None:
    """The searches' input on the CPU (their one definition is compiled CPU code; see searches.py)."""
    return None if t is None else t.cpu()


def importance_major(importance: torch.Tensor, rows: int, n: int) -> torch.Tensor:
    """Per-column importance [cols] laid out like `blocks_major(w, n)`: [n, rows*cols/n]."""
    per_row = importance.to(torch.float32).reshape(-1, n).t()  # [n, cols/n]
    return per_row.repeat(1, rows).contiguous()


def superblock_sum_x2(w: torch.Tensor) -> torch.Tensor:
    """Σx² over each 256-element super-block, accumulated in index order: [rows*cols/256]."""
    x = blocks_major(w, QK_K)
    return seq_sum(x * x)


def per_block(values: torch.Tensor, n_sub: int) -> torch.Tensor:
    """Repeat one value per super-block for each of its `n_sub` sub-blocks."""
    return values.repeat_interleave(n_sub)


def in_row_chunks(w: torch.Tensor, fn: Callable[..., dict[str, torch.Tensor]],
                  importance: torch.Tensor | None = None) -> dict[str, torch.Tensor]:  # fmt: skip
    """Apply `fn(rows_chunk, importance)` to chunks of whole rows and concatenate its outputs by row.

    The searches are long chains of small vector ops, for which torch's intra-op threads cost more in
    synchronisation than they gain (10x slower on a loaded 2-core machine). So the chunks run on
    single-threaded torch ops in parallel worker threads (torch releases the GIL), as many as torch
    was allowed threads; the results do not depend on the split."""
    rows, cols = w.shape
    step = max(1, CHUNK_ELEMENTS // cols)
    starts = range(0, rows, step)
    with single_threaded_ops() as workers:
        if workers > 1 and len(starts) > 1:
            parts = list(_pool(workers).map(lambda s: fn(w[s : s + step], importance), starts))
        else:
            parts = [fn(w[s : s + step], importance) for s in starts]
    return {k: torch.cat([p[k] for p in parts], dim=0) for k in parts[0]}


_POOLS: dict[int, ThreadPoolExecutor] = {}
_LOCK = threading.Lock()
_DEPTH = 0  # nesting of single_threaded_ops (the threads setting is process-wide)
_SAVED = 1


def _pool(workers: int) -> ThreadPoolExecutor:
    with _LOCK:
        if workers not in _POOLS:
            _POOLS[workers] = ThreadPoolExecutor(workers, thread_name_prefix="llmopt-grid")
        return _POOLS[workers]


class single_threaded_ops:  # noqa: N801 (a context manager used like a function)
    """Set torch to one intra-op thread while quantizing; yields how many threads it had (the
    workers to use). Nested and concurrent uses share one saved setting."""

    def __enter__(self) -> int:
        global _DEPTH, _SAVED
        with _LOCK:
            if _DEPTH == 0:
                _SAVED = torch.get_num_threads()
                torch.set_num_threads(1)
            _DEPTH += 1
            return _SAVED

    def __exit__(self, *exc: object) -> None:
        global _DEPTH
        with _LOCK:
            _DEPTH -= 1
            if _DEPTH == 0:
                torch.set_num_threads(_SAVED)


def to_rows(major: torch.Tensor, rows: int) -> torch.Tensor:
    """Inverse of blocks_major for levels: [n, B] -> [rows, cols]."""
    return major.t().reshape(rows, -1)


@dataclass(frozen=True)
class BlockParams:
    """One (super-)block's parameters for every row: the type's raw fields, and what they mean per
    sub-block as w = scale·q + offset ([rows, sub-blocks] each)."""

    fields: dict[str, torch.Tensor]
    scale: torch.Tensor
    offset: torch.Tensor
    sub: int  # columns per sub-block


class BlockGrid:
    """A GGML block type as a grid.

    Round to nearest (`quantize`) runs the type's reference search over whole rows in chunks:
    `chunk` quantizes rows into raw fields, `assemble` turns the fields into one QuantizedTensor.
    The searches run on the CPU (one compiled definition each, `searches.py`): a weight on another
    device goes there for the search and its result comes back to the weight's device.
    Error feedback (GPTQ) uses the same search one block at a time (`choose`, on the weights as
    they stand when the block starts), then rounds column by column against those fixed parameters
    (`round`, `value`) and collects the blocks (`assemble_spans`).
    """

    name: str
    # every weight is s·q − m for its code q (QuantizedTensor.dequantize is exact): codes are evenly
    # spaced, so learned rounding (quant/tune.py) can move one by a step; False for codebooks and lattices
    uniform: ClassVar[bool] = False
    # codes that are not every integer but a set of them, ascending (FP4's 15), each weight still s·q − m:
    # learned rounding moves a code to a neighbouring level
    code_levels: ClassVar[tuple[int, ...] | None] = None
    block: int  # elements per (super-)block: rows must be a multiple
    bits: int

    def quantize(self, weight: torch.Tensor, importance: torch.Tensor | None = None) -> QuantizedTensor:
        w = check_rows(weight, self.block, self.name)
        fields = in_row_chunks(w.cpu(), self.chunk, on_cpu(importance))
        return self.assemble(fields).to(weight.device)

    def chunk(self, w: torch.Tensor, importance: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def assemble(self, out: dict[str, torch.Tensor]) -> QuantizedTensor:
        raise NotImplementedError

    # ---------------------------------------------------------------------------- error feedback
    def span(self, cols: int) -> int:
        """Columns whose parameters are chosen together: one (super-)block; rows must fill whole blocks."""
        if cols % self.block:
            raise InputError(f"{self.name} needs rows that are a multiple of {self.block}, got {cols}")
        return self.block

    def choose(self, w: torch.Tensor, importance: torch.Tensor | None = None) -> BlockParams:
        """The reference search's parameters for one block of columns, `w` [rows, block]."""
        fields = self.search_fields(w, importance)
        qt = self.assemble(fields)
        offset = -qt.mins if qt.mins is not None else -float(1 << (self.bits - 1)) * qt.scales
        return BlockParams({k: v for k, v in fields.items() if k != "codes"}, qt.scales, offset, qt.group_size)

    def search_fields(self, w: torch.Tensor, importance: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """`chunk` of one block of columns run on the CPU, where the searches run (its rows in chunks on
        every thread, as `quantize`), its fields back on w's device."""
        fields = in_row_chunks(w.detach().to("cpu", torch.float32).contiguous(), self.chunk, on_cpu(importance))
        return {k: v.to(w.device) for k, v in fields.items()}

    def round(self, x: torch.Tensor, p: BlockParams, j: int) -> torch.Tensor:
        """Codes of column `j` of the block, x [rows], with fixed parameters (nearest level)."""
        a, b = p.scale[:, j // p.sub], p.offset[:, j // p.sub]
        q = torch.round((x - b) / torch.where(a == 0, torch.ones_like(a), a)).clamp_(0, (1 << self.bits) - 1)
        return torch.where(a == 0, torch.full_like(q, self._zero_code(p)), q)

    def value(self, q: torch.Tensor, p: BlockParams, j: int) -> torch.Tensor:
        return p.scale[:, j // p.sub] * q + p.offset[:, j // p.sub]

    def _zero_code(self, p: BlockParams) -> float:
        """The code stored where a sub-block's scale is 0 (every code means the offset there)."""
        return 0.0 if "dmin" in p.fields or "m" in p.fields else float(1 << (self.bits - 1))

    def assemble_spans(self, codes: torch.Tensor, params: list[BlockParams],
                        g_idx: torch.Tensor | None = None) -> QuantizedTensor:  # fmt: skip
        """The QuantizedTensor of `codes` [rows, cols] with one BlockParams per block, in column order."""
        if g_idx is not None:
            raise InputError(f"{self.name} has no column permutation (g_idx); use static groups with act-order")
        out = {k: torch.cat([p.fields[k] for p in params], dim=1) for k in params[0].fields}
        return self.assemble({"codes": codes.to(torch.uint8), **out})


def scale_min_fields(x: torch.Tensor, L: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor,
                     m: torch.Tensor, nmax: int, rows: int) -> dict[str, torch.Tensor]:  # fmt: skip
    """Q2_K/Q4_K/Q5_K: requantize every sub-block (x, L: [sub-blocks, n] by rows) against its stored
    scale d·sc and min dmin·m (sub-blocks whose scale is zero keep the search's levels L), then the
    raw fields by row."""
    n_sub = sc.numel() // d.numel()
    dd = per_block(d, n_sub) * sc
    dm = per_block(dmin, n_sub) * m
    return {
        "codes": requantize_rows(x, L, dd, dm, 0, nmax).reshape(rows, -1),
        "d": d.reshape(rows, -1).to(torch.float16),
        "dmin": dmin.reshape(rows, -1).to(torch.float16),
        "sc": sc.reshape(rows, -1).to(torch.uint8),
        "m": m.reshape(rows, -1).to(torch.uint8),
    }


def scale_min_tensor(out: dict[str, torch.Tensor], bits: int, group_size: int, grid: str) -> QuantizedTensor:
    """A QuantizedTensor from scale-and-min fields: scales = d·sc, mins = dmin·m in float32, as ggml."""
    n_sub = out["sc"].shape[1] // out["d"].shape[1]
    d = out["d"].to(torch.float32).repeat_interleave(n_sub, dim=1)
    dmin = out["dmin"].to(torch.float32).repeat_interleave(n_sub, dim=1)
    return QuantizedTensor(
        codes=out["codes"], scales=d * out["sc"].to(torch.float32), mins=dmin * out["m"].to(torch.float32),
        bits=bits, group_size=group_size, grid=grid, aux={k: out[k] for k in ("d", "dmin", "sc", "m")},
    )  # fmt: skip
