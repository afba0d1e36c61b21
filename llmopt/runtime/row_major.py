"""CPU decode layout: keep each linear's weight as W^T ([in, out], contiguous) and compute x @ W^T.

For one token a linear is a matrix-vector product that only streams the weights from memory.
On CPU BLAS the x @ W^T form (accumulating rows of W^T into the output) streams them about 1.5-2x
faster than F.linear's x · W^T with W [out, in] (measured on SmolLM2's shapes; see
benchmarks/runtime.py). Same weights, same dtype; only the memory layout differs.

Very wide outputs (the LM head: 49,152 columns for SmolLM2) lose that advantage on one thread,
because the output row being accumulated no longer stays in the first-level cache. Those are
stored as `chunks` slabs of W^T side by side ([chunks, in, width], width <= CHUNK_WIDTH) and
multiplied as one batched product. With tied embeddings the LM head's weight also serves the
embedding lookup, so nothing is stored twice.

Linears that read the same input are fused: q/k/v into one product and gate/up into another.
Fewer, larger matrix-vector products stream the same bytes with less per-call cost: SmolLM2's 210
per-layer products took 23.1 ms a token, the 120 fused ones 18.5 ms (2 threads, same weights).

Several rows at a time (a batch of sequences decoding together, prefill) are a different product:
there the BLAS behind x @ W^T ran SmolLM2's 8-row decode step at ~17 GFLOP/s. oneDNN's linear on a
weight it has reordered once, at load, into its own blocked layout (`OneDNNLinear`) ran the same
step in 56-67 ms instead of 120-136 ms, the batch-1 step unchanged (45-57 ms against 47-54, run to
run noise), prefill of 128 tokens 250 ms against 300-400 (2 threads, AMD EPYC). So wherever torch
has oneDNN, float32 linears take that layout; a tied LM head keeps the slabs above, which the
embedding lookup reads (a reordered weight has no rows to read, and a second copy would cost the
vocabulary's bytes again).

Decode reads every weight once a token, so a weight held in half the bytes streams in about half the
time. Where a model's weights are not float32 to begin with (an F16/BF16 checkpoint, anything
dequantized) and the runtime is decoding, linears hold them in float16 (`HalfLinear`): one to
`HALF_PRODUCT_ROWS` rows go through torch's float16 matrix-vector product (float32 accumulation, as
llama.cpp's F16 rows take float16 activations); more rows widen W to float32 tile by tile, as float16
matrix products are several times slower than float32's on CPUs without float16 arithmetic. SmolLM2's
default decode of its F16 file went from 27.9 to 48.1 tok/s (2 threads, AMD EPYC; docs/bench.md).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from llmopt.model.decoder import Decoder
from llmopt.runtime.gguf_linear import tiled_linear

CHUNK_WIDTH = 6144  # output columns per slab of a wide linear (measured best for the LM head on CPU)


def slab_count(out_features: int, width: int = CHUNK_WIDTH) -> int:
    """How many slabs a linear with `out_features` outputs is split into (1: not split)."""
    if out_features <= width:
        return 1
    fewest = -(-out_features // width)
    for k in range(fewest, 2 * fewest + 1):  # prefer an exact split: no padded columns
        if out_features % k == 0:
            return k
    return fewest


class RowMajorLinear(nn.Module):
    def __init__(self, linear: nn.Linear, width: int = CHUNK_WIDTH):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        k = slab_count(self.out_features, width)
        w_t = linear.weight.detach().t()
        self.slab_width = -(-self.out_features // k)
        if k * self.slab_width != self.out_features:  # pad the last slab with zero columns
            w_t = torch.cat([w_t, w_t.new_zeros(self.in_features, k * self.slab_width - self.out_features)], dim=1)
        # [k, in, width]: slab j holds output columns j*width .. (j+1)*width-1
        self.weight_t = nn.Parameter(w_t.reshape(self.in_features, k, self.slab_width).transpose(0, 1).contiguous(),
                                     requires_grad=False)
        self.bias = linear.bias

    @classmethod
    def stacked(cls, linears: list[nn.Linear], width: int = CHUNK_WIDTH) -> RowMajorLinear:
        """One linear computing all of `linears` (same input) side by side in its output."""
        weight, bias = stack_linears(linears)
        fused = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
        fused.weight = nn.Parameter(weight, requires_grad=False)
        if bias is not None:
            fused.bias = nn.Parameter(bias, requires_grad=False)
        return cls(fused, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_t.shape[0] == 1:
            y = x @ self.weight_t[0]
        else:  # [n, in] @ [k, in, w] -> [k, n, w] -> [n, k*w]
            flat = x.reshape(-1, self.in_features)
            y = torch.matmul(flat, self.weight_t).transpose(0, 1).reshape(flat.shape[0], -1)
            y = y[:, : self.out_features].reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def column(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` of the original W [out, in] (for a tied embedding lookup)."""
        return self.weight_t[index // self.slab_width, :, index % self.slab_width]


def stack_linears(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight and bias of one linear computing all of `linears` (same input) side by side
    (zeros for a part without a bias; None when none has one)."""
    bias = None
    if any(lin.bias is not None for lin in linears):
        bias = torch.cat([lin.bias.detach() if lin.bias is not None else lin.weight.new_zeros(lin.out_features)
                          for lin in linears])
    return torch.cat([lin.weight.detach() for lin in linears]), bias


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether this torch can reorder `dtype` linear weights for oneDNN (CPU builds with mkldnn)."""
    return (dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class OneDNNLinear(nn.Module):
    """x · W^T with W reordered once into oneDNN's blocked layout (an opaque tensor: no rows to read)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None))
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def stacked(cls, linears: list[nn.Linear]) -> OneDNNLinear:
        """One linear computing all of `linears` (same input) side by side in its output."""
        return cls(*stack_linears(linears))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if torch.compiler.is_compiling():  # (generate --compile) the product stays a call inside the graph
            y = onednn_linear(flat, self.packed, self.bias, self.out_features)
        else:
            y = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
        return y.reshape(*x.shape[:-1], self.out_features)


@torch.library.custom_op("llmopt::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """OneDNNLinear's product as an opaque op: inductor lowers mkldnn's own op only for weights it has
    reordered itself and fails on ours (an internal error under `generate --compile`)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@onednn_linear.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


HALF_PRODUCT_ROWS = 8  # rows up to which float16 products beat float32 tiles (decode, a batch, a draft's check)


def half_products() -> bool:
    """Whether torch's CPU kernels here are vectorized (float16 products run at the memory's speed);
    without vector units a float16 product is slower than float32's."""
    return torch.backends.cpu.get_cpu_capability() != "DEFAULT"


class HalfLinear(nn.Module):
    """x · W^T with W held in float16 and everything around it float32 (see the module docstring). A few
    rows are scaled by their largest magnitude before the float16 cast and back after, so no activation
    or output overflows float16's range (65,504) and none underflows: the product's only rounding is
    float16's on x and on y (relative 2^-11 each), its sums float32. More rows are exact: W widened."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight.detach().to(torch.float16).contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    @classmethod
    def stacked(cls, linears: list[nn.Linear]) -> HalfLinear:
        """One linear computing all of `linears` (same input) side by side in its output."""
        return cls(*stack_linears(linears))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.shape[0] > HALF_PRODUCT_ROWS:
            return tiled_linear(x, self.out_features, self.in_features, self.column, self.bias)
        scale = flat.abs().amax(-1, keepdim=True).clamp_(min=torch.finfo(torch.float32).tiny)
        y = torch.nn.functional.linear((flat / scale).to(torch.float16), self.weight).to(x.dtype).mul_(scale)
        y = y if self.bias is None else y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def column(self, index: torch.Tensor | slice) -> torch.Tensor:
        """Rows `index` of W [out, in], float32 (a tied embedding's lookup; the wide product's tiles)."""
        return self.weight[index].float()


class TiedEmbedding(nn.Module):
    """The embedding lookup read from the LM head's stored weight (rows of W are its columns)."""

    def __init__(self, head: RowMajorLinear | HalfLinear):
        super().__init__()
        self.head = head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head.column(ids)


def fuse_shared_inputs(model: Decoder, fuse: Callable[[list[nn.Module]], nn.Module | None],
                       after_each: Callable[[], None] = lambda: None) -> None:  # fmt: skip
    """Replace each block's q/k/v by `attn.qkv` and gate/up by `mlp.gate_up` wherever `fuse(linears)`
    gives one module for them (None leaves them apart): one product per input instead of three or two.
    `after_each` runs once the parts of each fused group are dropped (to hand their memory back)."""
    for block in model.layers:
        attn, mlp = block.self_attn, getattr(block, "mlp", None)
        groups = [(attn, "qkv", ("q_proj", "k_proj", "v_proj"))]
        if hasattr(mlp, "gate_up"):  # a dense MLP (a MoE block's experts, "mlp" in Qwen2-MoE, have no gate_up)
            groups.append((mlp, "gate_up", ("gate_proj", "up_proj")))
        for owner, fused_name, names in groups:
            if getattr(owner, fused_name, None) is not None:  # fused already (a GPTQ model's bit planes)
                continue
            if (fused := fuse([getattr(owner, n) for n in names])) is not None:
                setattr(owner, fused_name, fused)
                for n in names:
                    delattr(owner, n)
                after_each()


def use_row_major_linears(model: Decoder, width: int = CHUNK_WIDTH, onednn: bool | None = None,
                          half: bool = False) -> Decoder:
    """Swap every float nn.Linear of `model` (in place) for a HalfLinear with `half` (a decoding model
    whose weights are not float32 to begin with), else for a OneDNNLinear where torch has oneDNN for its
    dtype (`onednn` forces either way), a RowMajorLinear otherwise and for a tied LM head, whose weight the
    embedding lookup shares; q/k/v and gate/up fused where all of them are float linears."""
    tied = model.lm_head.weight is model.embed_tokens.weight or (
        model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr())
    if onednn is None:
        onednn = onednn_packs(model.lm_head.weight.dtype)

    def fuse(linears: list[nn.Module]) -> nn.Module | None:
        if not all(isinstance(m, nn.Linear) for m in linears):
            return None
        if half:
            return HalfLinear.stacked(linears)
        return OneDNNLinear.stacked(linears) if onednn else RowMajorLinear.stacked(linears, width)

    fuse_shared_inputs(model, fuse)
    for name in [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]:  # (names: no module held)
        module = model.get_submodule(name)
        parent, _, child = name.rpartition(".")
        if half:
            swapped = HalfLinear(module.weight, module.bias)
        elif not onednn or (tied and name == "lm_head"):
            swapped = RowMajorLinear(module, width)
        else:
            swapped = OneDNNLinear(module.weight, module.bias)
        setattr(model.get_submodule(parent) if parent else model, child, swapped)
    if tied:
        model.embed_tokens = TiedEmbedding(model.lm_head)
    return model
