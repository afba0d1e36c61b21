"""The layer-sequential quantization pipeline: one decoder block resident at a time.

For GPTQ: embed the calibration tokens, then for each block, in true-sequential order,
    q/k/v  ← Hessian of input_layernorm(x)
    o      ← Hessian of the attention output computed with the quantized q/k/v
    gate/up← Hessian of post_attention_layernorm(x + o(...)) with the quantized o
    down   ← Hessian of silu(gate)·up with the quantized gate/up
and the block's outputs, computed with all its quantized weights, become the next block's inputs.
With GPTAQ (`fp_target`), the full-precision model runs alongside: each block's four stage inputs
are also computed from the full-precision activations with the block's original weights, and each
stage's accumulator gathers the cross term between the two.
Linears that share an input (q/k/v, gate/up) share one Hessian and are quantized as one stacked
matrix, which is the same computation (GPTQ treats rows independently) done once.
RTN needs no data: each block's linears are rounded as they stream by.

The residual stream and every Hessian stay float32. The matrix products and attention of the
calibration forward run in `act_dtype`: float32, or bfloat16 where the hardware multiplies it
natively (about 3× faster on an AVX-512 BF16 CPU, and what GPTQModel uses on CPU). The weights
GPTQ quantizes are always the source's, read in float32; a bfloat16 copy of the block only
carries the forward.

`quantize_model` yields one `BlockResult` per block (then one for the head when asked), so a
writer can stream results to disk and drop them.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from llmopt.calibration.capture import StopForward, capture_inputs, embed
from llmopt.calibration.hessian import HessianAccumulator
from llmopt.model.decoder import Block, Rotary, load_block
from llmopt.model.source import ModelSource
from llmopt.quant.gptq import GPTQConfig, gptq_quantize
from llmopt.quant.metrics import weight_error
from llmopt.quant.rtn import RTNConfig, rtn_quantize
from llmopt.quant.tensor import QuantizedTensor

# Linears of a block in true-sequential order; each inner tuple shares one input.
STAGES: tuple[tuple[str, ...], ...] = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.o_proj",),
    ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp.down_proj",),
)
LINEARS = tuple(name for stage in STAGES for name in stage)
HEAD = "lm_head"


@dataclass(frozen=True)
class QuantizeSpec:
    method: str  # "rtn" or "gptq"
    rtn: RTNConfig | None = None
    gptq: GPTQConfig | None = None
    quantize_head: bool = False
    batch_size: int = 8  # calibration samples per forward chunk
    keep_bytes: int = 2 << 30  # keep the MLP activations between passes when they take at most this
    act_dtype: torch.dtype = torch.float32  # the calibration forward's products; Hessians stay float32

    @property
    def bits(self) -> int:
        return (self.gptq or self.rtn).bits  # type: ignore[union-attr]

    @property
    def group_size(self) -> int:
        return (self.gptq or self.rtn).group_size  # type: ignore[union-attr]

    @property
    def sym(self) -> bool:
        return (self.gptq or self.rtn).sym  # type: ignore[union-attr]


@dataclass
class LayerReport:
    name: str  # HF module name, e.g. model.layers.0.self_attn.q_proj
    shape: tuple[int, int]
    metrics: dict[str, float]
    gptq_loss: float | None = None
    damp: float | None = None


@dataclass
class BlockResult:
    layer: int  # block index, or -1 for the head
    tensors: dict[str, QuantizedTensor]  # HF module name -> quantized weight
    reports: list[LayerReport] = field(default_factory=list)
    seconds: float = 0.0


def module_name(layer: int, linear: str) -> str:
    return HEAD if layer < 0 else f"model.layers.{layer}.{linear}"


def quantize_model(source: ModelSource, spec: QuantizeSpec, tokens: torch.Tensor | None = None,
                   device: torch.device | str = "cpu") -> Iterator[BlockResult]:
    """Quantize every block's linears (and the head with `quantize_head`), one block at a time."""
    device = torch.device(device)
    if spec.method == "rtn":
        yield from _rtn_blocks(source, spec, device)
    elif spec.method == "gptq":
        if tokens is None:
            raise ValueError("GPTQ needs calibration tokens")
        yield from _gptq_blocks(source, spec, tokens, device)
    else:
        raise ValueError(f"unknown method {spec.method!r}")


def _rtn_blocks(source: ModelSource, spec: QuantizeSpec, device: torch.device) -> Iterator[BlockResult]:
    assert spec.rtn is not None
    for layer in range(source.arch.num_layers):
        start = time.perf_counter()
        result = BlockResult(layer, {})
        for linear in LINEARS:
            name = module_name(layer, linear)
            w = source.load(f"{name}.weight", dtype=torch.float32).to(device)
            _record(result, name, w, rtn_quantize(w, spec.rtn))
        source.release_pages()
        result.seconds = time.perf_counter() - start
        yield result
    if spec.quantize_head:
        start = time.perf_counter()
        w = head_weight(source).to(device)
        result = BlockResult(-1, {})
        _record(result, HEAD, w, rtn_quantize(w, spec.rtn))
        result.seconds = time.perf_counter() - start
        yield result


def head_weight(source: ModelSource) -> torch.Tensor:
    name = "lm_head.weight" if "lm_head.weight" in source.tensors else "model.embed_tokens.weight"
    return source.load(name, dtype=torch.float32)


def _record(result: BlockResult, name: str, w: torch.Tensor, qt: QuantizedTensor,
            loss: float | None = None, damp: float | None = None) -> torch.Tensor:
    deq = qt.dequantize(torch.float32)
    result.tensors[name] = _to_cpu(qt)
    result.reports.append(LayerReport(name, (int(w.shape[0]), int(w.shape[1])), weight_error(w, deq), loss, damp))
    return deq


def _to_cpu(qt: QuantizedTensor) -> QuantizedTensor:
    def c(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.cpu()

    return QuantizedTensor(qt.codes.cpu(), qt.scales.cpu(), qt.bits, qt.group_size, c(qt.zeros), c(qt.mins),
                           c(qt.g_idx), qt.grid, {k: v.cpu() for k, v in qt.aux.items()})


def _chunks(n: int, size: int) -> Iterator[slice]:
    for i in range(0, n, size):
        yield slice(i, min(i + size, n))


@torch.no_grad()
def _gptq_blocks(source: ModelSource, spec: QuantizeSpec, tokens: torch.Tensor, device: torch.device) -> Iterator[BlockResult]:
    assert spec.gptq is not None
    arch = source.arch
    x = embed(source, tokens, torch.float32, device)  # [n, t, hidden]: the current block's inputs
    x_fp = x.clone() if spec.gptq.fp_target > 0 else None  # the same, through the unquantized model
    n, t = tokens.shape
    dt = spec.act_dtype
    cos, sin = Rotary(arch).to(device)(0, t, dt)
    bs = max(1, spec.batch_size)
    for layer in range(arch.num_layers):
        start = time.perf_counter()
        block = load_block(source, layer, torch.float32, device)  # the weights GPTQ quantizes
        run = block if dt == torch.float32 else copy.deepcopy(block).to(dt)  # the one the forward uses
        result = BlockResult(layer, {})
        fp = _fp_stage_inputs(block, run, x_fp, cos, sin, bs) if x_fp is not None else None
        cross = fp is not None

        def attn_input(s: slice) -> torch.Tensor:
            return block.input_layernorm(x[s]).to(dt)

        def mlp_input(s: slice) -> torch.Tensor:
            return block.post_attention_layernorm(x[s]).to(dt)

        # q, k, v: inputs are the normed block inputs
        acc = HessianAccumulator(arch.hidden_size, device, cross)
        for s in _chunks(n, bs):
            acc.add(attn_input(s), fp and fp[0][s])
        _quantize_stage(block, run, layer, STAGES[0], acc, spec.gptq, result)
        del acc

        # o: inputs are the attention outputs with quantized q/k/v
        attn_out = torch.empty(n, t, arch.num_heads * arch.head_dim, dtype=dt, device=device)
        acc = HessianAccumulator(attn_out.shape[-1], device, cross)
        for s in _chunks(n, bs):
            attn_out[s] = _o_proj_input(run, attn_input(s), cos, sin)
            acc.add(attn_out[s], fp and fp[1][s])
        _quantize_stage(block, run, layer, STAGES[1], acc, spec.gptq, result)
        for s in _chunks(n, bs):
            x[s] += run.self_attn.o_proj(attn_out[s])  # x now holds the post-attention residual
        del attn_out, acc

        # gate, up: inputs are the normed post-attention residual
        acc = HessianAccumulator(arch.hidden_size, device, cross)
        for s in _chunks(n, bs):
            acc.add(mlp_input(s), fp and fp[2][s])
        _quantize_stage(block, run, layer, STAGES[2], acc, spec.gptq, result)
        del acc

        # down: inputs are silu(gate)·up with the quantized gate/up (kept for the outputs when they fit)
        acc = HessianAccumulator(arch.intermediate_size, device, cross)
        mlp = run.mlp
        keep = n * t * arch.intermediate_size * dt.itemsize <= spec.keep_bytes
        act = torch.empty(n, t, arch.intermediate_size, dtype=dt, device=device) if keep else None
        for s in _chunks(n, bs):
            h = mlp_input(s)
            m = F.silu(mlp.gate_proj(h)) * mlp.up_proj(h)
            acc.add(m, fp and fp[3][s])
            if act is not None:
                act[s] = m
        _quantize_stage(block, run, layer, STAGES[3], acc, spec.gptq, result)
        del acc, fp

        for s in _chunks(n, bs):  # the block's outputs with every weight quantized
            x[s] += mlp.down_proj(act[s]) if act is not None else mlp(mlp_input(s))
        del block, run, act
        result.seconds = time.perf_counter() - start
        yield result

    if spec.quantize_head:
        start = time.perf_counter()
        norm_w = source.load("model.norm.weight", dtype=torch.float32).to(device)
        acc = HessianAccumulator(arch.hidden_size, device, x_fp is not None)

        def final_norm(v: torch.Tensor) -> torch.Tensor:
            return norm_w * (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + arch.rms_norm_eps))

        for s in _chunks(n, bs):
            acc.add(final_norm(x[s]), None if x_fp is None else final_norm(x_fp[s]))
        w = head_weight(source).to(device)
        result = BlockResult(-1, {})
        r = gptq_quantize(w, acc.value(), spec.gptq, HEAD, acc.cross)
        _record(result, HEAD, w, r.tensor, r.loss, r.damp)
        result.seconds = time.perf_counter() - start
        yield result


def _fp_stage_inputs(block: Block, run: Block, x_fp: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     bs: int) -> list[torch.Tensor]:
    """What q/k/v, o, gate/up and down receive in the full-precision model (block still unquantized;
    `run` is its forward copy); `x_fp` is advanced in place to the block's full-precision outputs."""
    n, t, _ = x_fp.shape
    dt, attn = cos.dtype, run.self_attn
    widths = (x_fp.shape[-1], attn.n_heads * attn.head_dim, x_fp.shape[-1], run.mlp.down_proj.in_features)
    inputs = [torch.empty(n, t, w, dtype=dt, device=x_fp.device) for w in widths]
    for s in _chunks(n, bs):
        inputs[0][s] = h = block.input_layernorm(x_fp[s]).to(dt)
        inputs[1][s] = o = _o_proj_input(run, h, cos, sin)
        x_fp[s] += attn.o_proj(o)
        inputs[2][s] = h = block.post_attention_layernorm(x_fp[s]).to(dt)
        inputs[3][s] = m = F.silu(run.mlp.gate_proj(h)) * run.mlp.up_proj(h)
        x_fp[s] += run.mlp.down_proj(m)
    return inputs


def _o_proj_input(block: Block, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Run attention up to o_proj and return what o_proj would receive."""
    seen: list[torch.Tensor] = []
    with capture_inputs(block.self_attn.o_proj, seen.append, stop=True):
        try:
            block.self_attn(h, cos, sin)
        except StopForward:
            pass
    return seen[0]


def _quantize_stage(block: Block, run: Block, layer: int, linears: tuple[str, ...], acc: HessianAccumulator,
                    cfg: GPTQConfig, result: BlockResult) -> None:
    """GPTQ on the linears of one stage (stacked: they share `acc`'s Hessian), then load the quantized
    weights into `block` and its forward copy `run`."""
    modules = [block.get_submodule(name) for name in linears]
    weights = [m.weight.data for m in modules]
    stacked = torch.cat(weights, dim=0) if len(weights) > 1 else weights[0]
    label = module_name(layer, "+".join(n.split(".")[-1] for n in linears) if len(linears) > 1 else linears[0])
    r = gptq_quantize(stacked, acc.value(), cfg, label, acc.cross)
    row = 0
    for name, m, w in zip(linears, modules, weights):
        rows = slice(row, row + w.shape[0])
        row += w.shape[0]
        qt = r.tensor
        part = QuantizedTensor(qt.codes[rows], qt.scales[rows], qt.bits, qt.group_size,
                               None if qt.zeros is None else qt.zeros[rows], None, qt.g_idx, qt.grid)
        deq = _record(result, module_name(layer, name), w, part, float(r.row_loss[rows].sum()), r.damp)
        m.weight.data = deq.to(m.weight.dtype)
        if run is not block:
            copy_weight = run.get_submodule(name).weight
            copy_weight.data = deq.to(copy_weight.dtype)
