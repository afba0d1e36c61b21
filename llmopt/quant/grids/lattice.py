"""The lattice codebooks of the IQ2/IQ3 i-quants: grid points, the map onto them, nearest neighbours.

An IQ2/IQ3 group of `dims` magnitudes (8 for IQ2, 4 for IQ3) is stored as the index of one point of a
small codebook (256 of the 3^8 or 8^4 level combinations, picked by llama.cpp from the E8 / D4-like
lattice). llama.cpp's search (iq2xs_init_impl / iq3xs_init_impl in ggml-quants.c) rounds each
coordinate to its nearest level l, reads the combination's point from a map, and for a combination
that is not a point, compares the points at the `nwant` smallest integer distances (ordered by
distance, then index: the first of equal weighted errors wins). We build the same map and
neighbour lists from the stored point list (`codebooks`), once per type, on first use.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from llmopt.quant.grids.searches import f32_array, kernels

KEYS_AT_ONCE = 512  # keys whose distances to every point are held at once while building the lists (IQ1: 2048 points)


class Lattice:
    """A codebook of `len(kgrid)` points of `dims` coordinates, `bits` bits each (point p's coordinate
    i is level (p >> bits·i) & mask, standing for 2l + 1 in the search and `levels[l]` when read)."""

    def __init__(self, kgrid: tuple[int, ...], dims: int, bits: int, nwant: int, levels: tuple[int, ...]) -> None:
        self.kgrid, self.dims, self.bits, self.nwant = kgrid, dims, bits, nwant
        self.levels = levels  # what a level reads back as (ggml-common.h's grids)
        self.nlevels = len(levels)

    @functools.cached_property
    def coords(self) -> np.ndarray:
        """Level l of every point's coordinates, [points, dims]."""
        keys = np.asarray(self.kgrid, dtype=np.int64)
        shifts = self.bits * np.arange(self.dims)
        return ((keys[:, None] >> shifts) & ((1 << self.bits) - 1)).astype(np.int64)

    @functools.cached_property
    def keys(self) -> np.ndarray:
        """Every key a search can form (coordinates below `nlevels`), as its coordinates [keys, dims]."""
        size = 1 << (self.bits * self.dims)
        keys = np.arange(size, dtype=np.int64)
        return (keys[:, None] >> (self.bits * np.arange(self.dims))) & ((1 << self.bits) - 1)

    @functools.cached_property
    def index_of_key(self) -> torch.Tensor:
        """The point of each key, -1 where the key is not a point (llama.cpp's kmap), int64 [2^(bits·dims)]."""
        table = np.full(1 << (self.bits * self.dims), -1, dtype=np.int64)
        table[np.asarray(self.kgrid, dtype=np.int64)] = np.arange(len(self.kgrid))
        return torch.from_numpy(table)

    @functools.cached_property
    def neighbours(self) -> torch.Tensor:
        """For every key, the candidate points when it is not a point itself: all points at the `nwant`
        smallest squared distances of 2l + 1 coordinates, by (distance, index), padded with -1.
        int16 [keys, most candidates] (an on-grid key's row is unused)."""
        reachable = np.flatnonzero((self.keys < self.nlevels).all(axis=1))  # keys of levels 0..nlevels-1
        lists = [self._nearest_points(2 * self.keys[reachable[s : s + KEYS_AT_ONCE]] + 1)
                 for s in range(0, len(reachable), KEYS_AT_ONCE)]  # fmt: skip
        table = np.full((len(self.keys), max(part.shape[1] for part in lists)), -1, dtype=np.int16)
        for s, part in zip(range(0, len(reachable), KEYS_AT_ONCE), lists, strict=True):
            table[reachable[s : s + KEYS_AT_ONCE], : part.shape[1]] = part
        return torch.from_numpy(table)

    def _nearest_points(self, pos: np.ndarray) -> np.ndarray:
        """`neighbours` for positions pos [keys, dims] (2l + 1 coordinates): int16 [keys, most kept]."""
        grid = 2 * self.coords + 1  # [points, dims]
        d2 = np.zeros((len(pos), len(grid)), dtype=np.int32)
        for i in range(self.dims):
            d2 += (grid[None, :, i] - pos[:, None, i]).astype(np.int32) ** 2
        big = np.iinfo(np.int32).max
        limit = d2.min(axis=1)  # the nwant-th smallest distinct distance (or the largest there is)
        for _ in range(1, self.nwant):
            above = np.where(d2 > limit[:, None], d2, big).min(axis=1)
            limit = np.where(above == big, limit, above)
        keep = d2 <= limit[:, None]
        width = int(keep.sum(axis=1).max())
        # the kept points by (distance, index), as llama.cpp's compare: partition out the `width` smallest, sort those
        npts, none = d2.shape[1], np.iinfo(np.int64).max
        rank = np.where(keep, d2.astype(np.int64) * npts + np.arange(npts), none)
        part = np.argpartition(rank, width - 1, axis=1)[:, :width]
        order = np.take_along_axis(part, np.argsort(np.take_along_axis(rank, part, axis=1), axis=1), axis=1)
        return np.where(np.take_along_axis(rank, order, axis=1) < none, order, -1).astype(np.int16)

    @functools.cached_property
    def neighbour_counts(self) -> torch.Tensor:
        return (self.neighbours >= 0).sum(dim=1)

    @functools.cached_property
    def compact_map(self) -> tuple[np.ndarray, np.ndarray]:
        """`index_of_key` and `neighbours` in the compact form the compiled search reads (llama.cpp's
        kmap and neighbour list): map int32 [keys], a point's index, or for an off-lattice key -(s + 1)
        where list[s] is its candidate count and list[s+1 ...] the candidates (int16). A few hundred
        kB, where the padded table is megabytes (IQ2: 65536 keys x 150)."""
        kmap = self.index_of_key.numpy().astype(np.int32)
        counts = self.neighbour_counts.numpy()
        off = np.flatnonzero((kmap < 0) & (counts > 0))
        n = counts[off]
        starts = np.concatenate([[0], np.cumsum(n + 1)[:-1]]).astype(np.int64)
        flat = np.zeros(int((n + 1).sum()), dtype=np.int16)
        flat[starts] = n
        cols = np.arange(self.neighbours.shape[1])
        taken = cols[None, :] < n[:, None]
        flat[(starts[:, None] + 1 + cols[None, :])[taken]] = self.neighbours.numpy()[off][taken]
        kmap[off] = -(starts + 1)
        return kmap, flat

    @functools.cached_property
    def read_values(self) -> torch.Tensor:
        """What every point's coordinates read back as (ggml-common.h's grid), float32 [points, dims]."""
        return torch.tensor(self.levels, dtype=torch.float32)[torch.from_numpy(self.coords)]

    def key(self, levels: torch.Tensor) -> torch.Tensor:
        """The key of level groups [..., dims] (integer-valued floats): Σ l_i << bits·i."""
        weights = torch.tensor([1 << (self.bits * i) for i in range(self.dims)], dtype=torch.int64)
        return (levels.to(torch.int64) * weights).sum(dim=-1)

    def best_neighbour(self, keys: torch.Tensor, xval: torch.Tensor, waux: torch.Tensor, scale: torch.Tensor,
                       level_values: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """llama.cpp's iq2/iq3_find_best_neighbour (iq1_find_best_neighbour2) for off-grid groups: among
        a key's candidates, the first with the least Σ waux·(scale·q - x)·(scale·q - x), summed in
        coordinate order in float32. keys [n], xval/waux [n, dims], scale [n] -> point index [n].
        q is level l's 2l + 1, or `level_values[group, l]` when given ([n, levels]: IQ1's shifted levels)."""
        best = torch.empty(keys.shape, dtype=torch.int64)
        values = level_values if level_values is not None else 2 * torch.arange(self.nlevels)[None] + 1
        kernels().neighbour_points(keys.numpy(), f32_array(xval), f32_array(waux), f32_array(scale), f32_array(values),
                                   *self.compact_map, self.coords, best.numpy())  # fmt: skip
        return best
