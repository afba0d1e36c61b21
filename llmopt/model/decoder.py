"""A pure-PyTorch Llama-style decoder (Llama, Mistral, Qwen2, Qwen3), readable top to bottom.

This is the one definition of the block: the runtime (whole model, KV cache, the compiled decode
step), the quantization pipeline and the imatrix collector (one block at a time, observing the
linears' inputs with hooks) all run `DecoderBlock.forward`. A family chooses its options (q/k
norms, biases, sliding window) and could supply a block of its own (`Family.make_block`).
Parameter names match HF's without the leading "model.", so weights load straight from any
`ModelSource`. No transformers modelling code is used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from llmopt.errors import InputError
from llmopt.model.rope import inv_freq, long_from
from llmopt.model.source import ModelSource

if TYPE_CHECKING:  # a type only: arch.py reads the families, which build these blocks
    from llmopt.model.arch import ArchSpec


@dataclass
class AttentionGroup:
    """Sequences of a packed forward that attend together, padded to one shape: B sequences,
    up to t queries each, over the keys of up to n cache blocks each (s = n * block_size)."""

    queries: torch.Tensor  # [B, t] indices into the packed token axis (padding repeats a valid one)
    valid: torch.Tensor  # [B, t] bool: which of them are real
    blocks: torch.Tensor  # [B, n] each sequence's cache blocks, oldest first (padding: any block)
    block_size: int
    mask: torch.Tensor  # [B, 1, t, s] bool: which keys each query may see
    window_mask: torch.Tensor | None = None  # the same for sliding-window layers (None: `mask`)


@dataclass
class Packed:
    """Several sequences packed along one token axis ([1, T] ids), as continuous batching runs them:
    each token has its own position, its own cache slot to write, and attends only within its own
    sequence (`groups`). The linears see one matrix of T rows; attention runs group by group."""

    positions: torch.Tensor  # [T] position of each token in its sequence (for rope)
    slots: torch.Tensor  # [T] the cache slot each token's K/V is written to
    groups: list[AttentionGroup]


Position = int | torch.Tensor | Packed  # where a forward's tokens start: an int, a [1] tensor in a fixed-shape step,
# or a packed batch of sequences


class KVCache(Protocol):
    """What attention needs from a cache: store this step's K/V at `start`, return the K/V to attend
    over (every position so far; for a tensor `start`, the whole fixed-size buffer; for a `Packed`
    batch, every slot, [kv_heads, slots, head_dim], which its groups index)."""

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: Position) -> tuple[torch.Tensor, torch.Tensor]: ...


class RMSNorm(nn.Module):
    """x / rms(x) scaled by (shift + weight): shift 0 for Llama's families, 1 for Gemma's, whose
    weights are stored as the offset from 1 (`Family.norm_shift`)."""

    def __init__(self, dim: int, eps: float, shift: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if shift else torch.ones(dim))
        self.eps = eps
        self.shift = shift

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one fused kernel; in float32 like the reference implementations, whatever the model dtype
        if self.shift:  # Gemma: (shift + weight) in float32, the product cast back (as transformers)
            h = F.rms_norm(x.to(torch.float32), (x.shape[-1],), eps=self.eps)
            return (h * (self.shift + self.weight.float())).to(x.dtype)
        if x.dtype == torch.float32:  # the weight joins the same kernel: one op per norm in decode
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        h = F.rms_norm(x.to(torch.float32), (x.shape[-1],), eps=self.eps)
        return self.weight * h.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Attention(nn.Module):
    def __init__(self, arch: ArchSpec, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.window = arch.sliding_window
        bias = arch.attention_bias
        self.q_proj = nn.Linear(arch.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(arch.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(arch.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, arch.hidden_size, bias=False)
        if arch.family.qk_norm:  # one RMSNorm over each head's q and k (Qwen3, Gemma 3)
            self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps, arch.family.norm_shift)
            self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps, arch.family.norm_shift)
        self.qkv: nn.Module | None = None  # q, k, v as one linear, when the runtime fuses them (row_major.py)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v projections of x (one matrix product when fused)."""
        if self.qkv is not None:
            kv = self.n_kv * self.head_dim
            return self.qkv(x).split((self.n_heads * self.head_dim, kv, kv), dim=-1)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start: Position = 0,
                cache: KVCache | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.project(x)
        q = q.reshape(b, t, self.n_heads, self.head_dim)
        k = k.reshape(b, t, self.n_kv, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.reshape(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if cache is not None:
            k, v = cache.update(self.layer, k, v, start)
        if isinstance(start, Packed):
            o = packed_attention(q, k, v, start, self.window is not None)
        else:
            o = attend(q, k, v, attention_mask(t, k.shape[2], start, self.window, x.device))
        del q, k, v  # not held while o_proj runs (the quantization pipeline pauses there, every chunk at once)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, -1))


SMALL_QUERY = 16  # decode steps and speculative verification: at most this many new tokens


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """softmax(q kᵀ / √d) v for q [b, heads, t, d] over k, v [b, kv_heads, s, d] (grouped-query);
    `mask` [t, s] or [b, 1, t, s] marks the keys each query sees (None: plain causal)."""
    t = q.shape[2]
    if t <= SMALL_QUERY:
        return grouped_attention(q, k, v, mask)
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and t > 1)


def packed_attention(q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor, packed: Packed,
                     sliding: bool = False) -> torch.Tensor:  # fmt: skip
    """Attention for a packed batch: q [1, heads, T, d]; k_slots, v_slots [kv_heads, slots, d] (the
    whole cache layer). Each group gathers its sequences' queries and key blocks into one padded
    batch (`index_select` of whole blocks: several times faster on CPU than indexing slot by slot).
    A `sliding` layer (Gemma 3 mixes them with global ones) takes the groups' window masks."""
    out = torch.empty_like(q[0])
    h, _, d = out.shape
    for g in packed.groups:
        b, t = g.queries.shape
        qg = q[0].index_select(1, g.queries.flatten()).view(h, b, t, d).transpose(0, 1)
        mask = g.window_mask if sliding and g.window_mask is not None else g.mask
        o = attend(qg, gather_blocks(k_slots, g), gather_blocks(v_slots, g), mask)  # [B, heads, t, d]
        out.index_copy_(1, g.queries[g.valid], o.transpose(0, 1)[:, g.valid])
    return out[None]


def gather_blocks(slots: torch.Tensor, g: AttentionGroup) -> torch.Tensor:
    """[kv_heads, slots, d] -> [B, kv_heads, n * block_size, d]: each sequence's keys (or values) in order."""
    kv, _, d = slots.shape
    b, n = g.blocks.shape
    blocks = slots.view(kv, -1, g.block_size, d).index_select(1, g.blocks.flatten())
    return blocks.view(kv, b, n * g.block_size, d).transpose(0, 1)


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Attention for a few queries over a long cache, without copying K/V once per query head.

    Query heads that share a KV head are folded into the query axis, so one matmul serves the whole
    group (SDPA would need K/V repeated). It is also steadier than SDPA's threaded CPU kernel, whose
    per-call overhead dominates when there is only one query.
    """
    b, h, t, d = q.shape
    n_kv = k.shape[1]
    rep = h // n_kv
    scores = (q.reshape(b, n_kv, rep * t, d) @ k.transpose(-1, -2)) * (d ** -0.5)  # [b, n_kv, rep*t, s]
    if mask is None and t > 1:  # plain causal: the queries are the last t positions
        mask = torch.ones(t, k.shape[2], dtype=torch.bool, device=q.device).tril(k.shape[2] - t)
    if mask is not None:  # the rows of one KV head's group are (query head, query) pairs, heads outermost
        scores = scores.masked_fill(~(mask.repeat(rep, 1) if mask.dim() == 2 else mask.repeat(1, 1, rep, 1)), float("-inf"))
    weights = scores.float().softmax(-1).to(v.dtype)
    return (weights @ v).view(b, h, t, d)


def attention_mask(t: int, s: int, start: Position, window: int | None, device: torch.device) -> torch.Tensor | None:
    """Boolean [t, s] mask for queries at positions start..start+t-1 over keys 0..s-1, or None when
    plain causal masking (or none, for one query) is exact. A tensor `start` (a fixed-shape step
    attending over a whole preallocated buffer) always gets a mask."""
    fixed = isinstance(start, torch.Tensor)
    if not fixed and (window is None or window >= s) and (t == 1 or (start == 0 and s == t)):
        return None
    q_pos = (start + torch.arange(t, device=device))[:, None]
    k_pos = torch.arange(s, device=device)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    return allowed


class MLP(nn.Module):
    def __init__(self, arch: ArchSpec):
        super().__init__()
        self.gate_proj = nn.Linear(arch.hidden_size, arch.intermediate_size, bias=False)
        self.up_proj = nn.Linear(arch.hidden_size, arch.intermediate_size, bias=False)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)
        self.gate_up: nn.Module | None = None  # gate and up as one linear, when the runtime fuses them
        self.act = ACTIVATIONS[arch.family.activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            gate, up = self.gate_up(x).chunk(2, dim=-1)
            return self.down_proj(self.act(gate) * up)
        # one expression: gate and up are freed before down_proj runs (the pipeline pauses there)
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# the gated MLP's activations, by transformers' `hidden_act` names (SwiGLU; Gemma's GeGLU)
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": _gelu_tanh}


class DecoderBlock(nn.Module):
    """One decoder layer: pre-norm attention and pre-norm SwiGLU MLP, each with a residual."""

    def __init__(self, arch: ArchSpec, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, arch.family.norm_shift)
        self.self_attn = Attention(arch, layer)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, arch.family.norm_shift)
        self.mlp = MLP(arch)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start: Position = 0,
                cache: KVCache | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, start, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Rotary(nn.Module):
    """cos/sin tables for given positions, computed in float32 like the reference implementations.

    Longrope (Phi-3 128k) has two sets of frequencies: a forward whose last position reaches past
    the original context takes the long factors for all its positions, as transformers does per
    forward (so a prompt run in chunks passes `reach`, the end of the whole prompt, to every chunk;
    the generation loop recomputes the cache at the first step past it, as transformers' Phi-3 does).
    A packed batch takes each token's row from the table a decode step at its position uses."""

    def __init__(self, arch: ArchSpec):
        super().__init__()
        tables = arch.family.rope_archs(arch)  # [head_dim / 2], or one row per table (Gemma 3: two)

        def freqs(long: bool) -> torch.Tensor:  # on the CPU, in a model built on the meta device too (moved with
            # it later): a meta tensor's arithmetic imports torch._dynamo at its first call, 1 s of a model load
            with torch.device("cpu"):
                return inv_freq(tables[0], long) if len(tables) == 1 else torch.stack([inv_freq(a, long) for a in tables])

        self.register_buffer("inv_freq", freqs(False), persistent=False)
        self.long_from = long_from(tables[0])  # None: one set of frequencies
        if self.long_from is not None:
            self.register_buffer("long_inv_freq", freqs(True), persistent=False)
        self.tables: dict[bool, tuple[torch.Tensor, torch.Tensor]] = {}  # long? -> cos, sin for positions 0..n-1

    def forward(self, start: int, length: int, dtype: torch.dtype, reach: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows start..start+length-1 of the table a forward ending at max(start + length, reach) uses."""
        end = start + length
        cos, sin = self._table(self.long_from is not None and max(end, reach) > self.long_from, end, dtype)
        return cos[start:end], sin[start:end]

    def _table(self, long: bool, end: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        table = self.tables.get(long)
        if table is None or table[0].shape[0] < end or table[0].dtype != dtype:
            size = max(end, 2 * (table[0].shape[0] if table is not None else 256))
            table = self.tables[long] = self.compute(0, size, dtype, long)  # grown rarely: decode steps slice it
        return table

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows of arbitrary positions (a packed batch: each token at its own, from the table a
        decode step at that position uses)."""
        cos, sin = self.stepwise(int(positions.max()) + 1, dtype)
        return cos[positions], sin[positions]

    def stepwise(self, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows 0..length-1, each from the table a one-token forward at that position uses (what the
        fixed-shape decode step selects from by its tensor position)."""
        if self.long_from is None or length <= self.long_from:
            return self(0, length, dtype)
        short, long = self._table(False, length, dtype), self._table(True, length, dtype)
        cut = self.long_from  # a token at position p takes the long table once p + 1 > long_from
        return torch.cat([short[0][:cut], long[0][cut:length]]), torch.cat([short[1][:cut], long[1][cut:length]])

    def compute(self, start: int, length: int, dtype: torch.dtype, long: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(start, start + length, device=self.inv_freq.device, dtype=torch.float32)
        inv = (self.long_inv_freq if long else self.inv_freq).float()
        freqs = pos.view(-1, *[1] * inv.dim()) * inv  # [n, half] or [n, tables, half]
        emb = torch.cat((freqs, freqs), dim=-1).flatten(1)  # several tables: side by side
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _embedding(rows: int, dim: int) -> nn.Embedding:
    """nn.Embedding, left uninitialized when built on the meta device (the runtime assigns the file's table): a
    meta tensor's random `normal_` imports torch._dynamo at its first call, 1 s of every model load."""
    if torch.get_default_device().type == "meta":
        return nn.Embedding(rows, dim, _weight=torch.empty(rows, dim))
    return nn.Embedding(rows, dim)


class Decoder(nn.Module):
    """Embeddings, blocks, final norm and LM head. `forward(ids, start, cache) -> logits`."""

    def __init__(self, arch: ArchSpec):
        super().__init__()
        self.arch = arch
        self.embed_tokens = _embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(arch.family.make_block(arch, i) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, arch.family.norm_shift)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.rotary = Rotary(arch)

    def forward(self, ids: torch.Tensor, start: int = 0, cache: KVCache | None = None) -> torch.Tensor:
        return self.lm_head(self.hidden(ids, start, cache))

    def hidden(self, ids: torch.Tensor, start: Position = 0, cache: KVCache | None = None,
               rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Final-norm hidden states: prefill applies the LM head to the last position only.
        `rope` gives the cos/sin rows of these positions (a fixed-shape step selects them itself).
        A `Packed` start runs several sequences as one [1, T] row (continuous batching)."""
        return self.hidden_of(self.embed(ids), start, cache, rope)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Input embeddings [.., T, hidden] of token ids (scaled as the family wants)."""
        return embed_scaled(self.embed_tokens(ids), self.arch)

    def hidden_of(self, x: torch.Tensor, start: Position = 0, cache: KVCache | None = None,
                  rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """`hidden` from the input embeddings `x` [B, T, hidden] (the compiled decode step looks them up
        outside its graph)."""
        if rope is None:
            rope = self.rotary.at(start.positions, x.dtype) if isinstance(start, Packed) else self.rotary(start, x.shape[1], x.dtype)
        cos, sin = rope
        for block in self.layers:
            x = block(x, cos, sin, start, cache)
        return self.norm(x)

    @classmethod
    def from_source(cls, source: ModelSource, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu") -> Decoder:
        """Build the model and fill it tensor by tensor from `source` (no full copy in between)."""
        arch = source.arch
        with torch.device("meta"):
            model = cls(arch)
        state = {}
        for name in source.tensors:
            state[hf_to_param_name(name)] = source.load(name, dtype=torch.float32).to(device=device, dtype=dtype)
        if arch.tie_word_embeddings or "lm_head.weight" not in state:
            state["lm_head.weight"] = state["embed_tokens.weight"]
        missing = set(model.state_dict()) - set(state)
        if missing:
            raise InputError(f"{source.path}: missing tensors {sorted(missing)[:3]}{' ...' if len(missing) > 3 else ''}")
        model.load_state_dict(state, strict=True, assign=True)
        model.rotary = Rotary(arch).to(device)
        return model.eval()


def embed_scaled(x: torch.Tensor, arch: ArchSpec) -> torch.Tensor:
    """Embedding rows as block 0 reads them: Gemma scales them by sqrt(hidden_size), the factor
    rounded to the rows' dtype first (as transformers does; llama.cpp scales in float32)."""
    if not arch.family.scale_embedding:
        return x
    return x * torch.tensor(arch.hidden_size ** 0.5, dtype=x.dtype)


def hf_to_param_name(hf_name: str) -> str:
    """HF tensor name -> this module's parameter name ("model.layers.0..." -> "layers.0...")."""
    return hf_name.removeprefix("model.")


def load_block(source: ModelSource, layer: int, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> nn.Module:
    """One decoder block with its weights, for layer-at-a-time work (quantization, imatrix)."""
    with torch.device("meta"):
        block = source.arch.family.make_block(source.arch, layer)
    prefix = f"model.layers.{layer}."
    state = {n[len(prefix):]: source.load(n, dtype=torch.float32).to(device=device, dtype=dtype)
             for n in source.tensors if n.startswith(prefix)}
    block.load_state_dict(state, strict=True, assign=True)
    source.release_pages()  # the block is copied out; its file pages need not stay resident
    for module in block.modules():  # a MoE layer runs every expert, so each chunk reaches every expert's stage
        if hasattr(module, "every_expert"):
            module.every_expert = True
    return block.eval()
