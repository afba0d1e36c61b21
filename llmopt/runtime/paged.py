"""A paged KV cache: fixed-size blocks from one pool, with prefix sharing (vLLM's PagedAttention and
automatic prefix caching, at the scale of one machine and in plain torch).

The pool holds K and V for every layer as `[layers, kv_heads, blocks * block_size, head_dim]`; a
*slot* is one token position in it and block `b` owns slots `b*block_size .. (b+1)*block_size-1`.
A sequence owns a block table (a list of block ids), so it grows a block at a time without
reserving its whole length up front, and its blocks go back to the pool when it ends. Attention
reads a sequence's keys by gathering its slots (`decoder.packed_attention`): a copy a fused kernel
would avoid, the price of staying in torch (benchmarks/prefix_cache.py measures it).

Prefix sharing: a full block is named by a hash of every token up to and including it (chained
through the previous block's hash), so equal names mean equal K/V. Blocks are reference-counted;
when the last user lets go of a named block it stays cached (evictable, least recently used first)
until the pool needs it, and a later prompt that starts with the same tokens takes it instead of
recomputing it.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

import torch

from llmopt.model.arch import ArchSpec
from llmopt.model.decoder import SMALL_QUERY, AttentionGroup, Packed


def chain_hash(parent: bytes, tokens: list[int]) -> bytes:
    """The name of a full block: its tokens and, through `parent`, every token before them."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


def prefix_hashes(ids: list[int], block_size: int, blocks: int) -> list[bytes]:
    """Chained hashes of the first `blocks` full blocks of `ids`."""
    hashes: list[bytes] = []
    for i in range(blocks):
        hashes.append(chain_hash(hashes[-1] if hashes else b"", ids[i * block_size:(i + 1) * block_size]))
    return hashes


class BlockPool:
    """The blocks, who holds them, and the prefix cache; also the `KVCache` of a packed forward."""

    def __init__(self, arch: ArchSpec, num_blocks: int, block_size: int = 16, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a pool needs at least one block of at least one slot, got {num_blocks} x {block_size}")
        shape = (arch.num_layers, arch.num_kv_heads, num_blocks * block_size, arch.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.refs = [0] * num_blocks
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))  # never used or unnamed: popped from the end
        self.cached: dict[bytes, int] = {}  # name -> block holding that prefix's K/V
        self.name: dict[int, bytes] = {}  # block -> its name, for named blocks
        self.evictable: OrderedDict[int, None] = OrderedDict()  # named blocks nobody holds, least recent first

    @property
    def available(self) -> int:
        """Blocks that `allocate` can hand out now (free ones and cached ones nobody holds)."""
        return len(self.free) + len(self.evictable)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def allocate(self, n: int) -> list[int] | None:
        """`n` blocks for one holder, or None (and nothing taken) if the pool has not that many."""
        if n > self.available:
            return None
        blocks = []
        for _ in range(n):
            if self.free:
                block = self.free.pop()
            else:  # evict the least recently used cached prefix block
                block, _ = self.evictable.popitem(last=False)
                del self.cached[self.name.pop(block)]
            self.refs[block] = 1
            blocks.append(block)
        return blocks

    def release(self, blocks: list[int]) -> None:
        """Let go of `blocks` (in reverse, so a sequence's first blocks are the last evicted)."""
        for block in reversed(blocks):
            self.refs[block] -= 1
            assert self.refs[block] >= 0, f"block {block} released more often than taken"
            if self.refs[block] == 0:
                if block in self.name:
                    self.evictable[block] = None  # most recently used: evicted last
                else:
                    self.free.append(block)

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """Take the cached blocks of the longest prefix named by `hashes` (one more holder each)."""
        blocks = []
        for h in hashes:
            block = self.cached.get(h)
            if block is None:
                break
            if self.refs[block] == 0:
                del self.evictable[block]
            self.refs[block] += 1
            blocks.append(block)
        return blocks

    def register(self, block: int, name: bytes) -> None:
        """`block` is full and holds the prefix `name`: let later prompts share it. When another block
        already holds that prefix (two requests computed it at once), this one stays private."""
        if name not in self.cached and block not in self.name:
            self.cached[name] = block
            self.name[block] = name

    def slots(self, blocks: list[int], start: int, end: int) -> torch.Tensor:
        """The slots of positions start..end-1 of a sequence with block table `blocks`."""
        pos = torch.arange(start, end)
        return torch.tensor(blocks, dtype=torch.long)[pos // self.block_size] * self.block_size + pos % self.block_size

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: Packed) -> tuple[torch.Tensor, torch.Tensor]:
        """Write a packed forward's K/V ([1, kv_heads, T, head_dim]) to its slots; return the layer's
        whole store for the attention groups to gather from."""
        self.k[layer].index_copy_(1, start.slots, k[0])
        self.v[layer].index_copy_(1, start.slots, v[0])
        return self.k[layer], self.v[layer]


def pack(pool: BlockPool, chunks: list[tuple[list[int], int, int]], window: int | None,
         device: torch.device | str = "cpu") -> Packed:
    """The layout of one packed forward: `chunks` gives, per sequence in packed order, its block table,
    the position of its first new token, and how many new tokens it brings. Sequences with a few
    new tokens (decode steps, draft verification) attend as one padded batch; each longer prefill
    chunk attends on its own (padding it with the short ones would multiply the work)."""
    offsets, offset = [], 0
    for _, _, n in chunks:
        offsets.append(offset)
        offset += n
    positions = torch.cat([torch.arange(start, start + n) for _, start, n in chunks])
    slots = torch.cat([pool.slots(blocks, start, start + n) for blocks, start, n in chunks])
    short = [i for i, (_, _, n) in enumerate(chunks) if n <= SMALL_QUERY]
    members = ([short] if short else []) + [[i] for i, (_, _, n) in enumerate(chunks) if n > SMALL_QUERY]
    groups = [_group(pool, [chunks[i] for i in m], [offsets[i] for i in m], window, device) for m in members]
    return Packed(positions.to(device), slots.to(device), groups)


def _group(pool: BlockPool, chunks: list[tuple[list[int], int, int]], offsets: list[int], window: int | None,
           device: torch.device | str) -> AttentionGroup:
    bs = pool.block_size
    t = max(n for _, _, n in chunks)
    nb = max(-(-(start + n) // bs) for _, start, n in chunks)
    queries = torch.zeros(len(chunks), t, dtype=torch.long)
    valid = torch.zeros(len(chunks), t, dtype=torch.bool)
    table = torch.zeros(len(chunks), nb, dtype=torch.long)  # padding blocks: block 0, masked out
    q_pos = torch.zeros(len(chunks), t, dtype=torch.long)  # padding queries sit at position 0: they see one key
    for b, ((blocks, start, n), off) in enumerate(zip(chunks, offsets)):
        used = -(-(start + n) // bs)
        queries[b] = off
        queries[b, :n] = torch.arange(off, off + n)
        valid[b, :n] = True
        table[b, :used] = torch.tensor(blocks[:used])
        q_pos[b, :n] = torch.arange(start, start + n)
    k_pos = torch.arange(nb * bs)[None, None, :]
    mask = k_pos <= q_pos[:, :, None]
    window_mask = None if window is None else (mask & (k_pos > q_pos[:, :, None] - window))[:, None].to(device)
    return AttentionGroup(queries.to(device), valid.to(device), table.to(device), bs, mask[:, None].to(device), window_mask)
