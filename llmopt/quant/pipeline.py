"""The layer-sequential quantization pipeline: one decoder block resident at a time.

For a calibrated method (GPTQ): embed the calibration tokens, then for each block run the block's
own forward over them (staged.py) and walk the family's stage table in order: each stage's input
is observed where its linears receive it, with the earlier stages already quantized (GPTQ's
true-sequential order); the method turns those statistics into quantized weights, which replace
the block's weights before the forward goes on. The block's outputs, computed with all its
quantized weights, become the next block's inputs. With GPTAQ (`full_precision_inputs`) the
unquantized block also runs over the full-precision activations first, and each stage's
statistics get both inputs. Learned rounding keeps the full-precision activations too: its targets
are the float model's block outputs, so each block also makes up for the error the quantized blocks
before it left in its inputs (AutoRound's default).
A method without data (RTN) rounds each block's linears as they stream by.

The residual stream and every statistic stay float32. The linears of the calibration forward
(and everything between them) run in `act_dtype`: float32, or bfloat16 where the hardware
multiplies it natively (about 3x faster on an AVX-512 BF16 CPU, and what GPTQModel uses on CPU);
the norms that read the residual stream (the stages' producers) stay float32. The weights a method
quantizes are always the source's, read in float32; a bfloat16 copy of the block only carries the
forward.

`quantize_model` yields one `BlockResult` per block (then one for the head when asked), so the
caller can hand each to a writer (`formats`) and drop it.
"""

from __future__ import annotations

import dataclasses

import copy
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from llmopt.calibration.capture import embed
from llmopt.errors import OptionError
from llmopt.model.decoder import RMSNorm, Rotary, load_block
from llmopt.model.families.base import HEAD, Stage
from llmopt.model.source import ModelSource
from llmopt.quant.grids import Grid
from llmopt.quant.method import BlockAccess, Collector, Method, MethodConfig, Quantized
from llmopt.quant.metrics import weight_error
from llmopt.quant.rtn import RTN, RTNConfig
from llmopt.quant.staged import StagedForward
from llmopt.quant.tune import TuneConfig, block_forward, tunable, tune_block
from llmopt.options import QuantizeOptions
from llmopt.quantized_tensor import QuantizedTensor

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class QuantizeSpec:
    """What to quantize and how: a method config (RTNConfig, GPTQConfig), and where its rounding goes."""

    method: MethodConfig
    quantize_head: bool = QuantizeOptions.quantize_head
    batch_size: int = QuantizeOptions.batch_size  # calibration samples per forward chunk
    act_dtype: torch.dtype = torch.float32  # the calibration forward's products; statistics stay float32
    grids: Callable[[str], Grid] | None = None  # the grid of each module (HF name); default: the method's own
    # Per-module (bits, group_size) on the method's integer grid (GPTQModel's `dynamic`): the automatic mix.
    dynamic: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    tune: TuneConfig | None = None  # learned rounding of each block after the method (quant/tune.py)

    @property
    def calibrated(self) -> bool:
        """Whether the pipeline runs the calibration forward: a calibrated method, or tuning."""
        return self.tune is not None or self.method.build().calibrated

    def grid_for(self, module: str) -> Grid:
        if self.grids is not None:
            return self.grids(module)
        grid = self.method.grid()
        if module in self.dynamic:
            bits, group_size = self.dynamic[module]
            return dataclasses.replace(grid, bits=bits, group_size=group_size)
        return grid

    def module_bits(self, module: str) -> tuple[int, int]:
        """(bits, group_size) of one module's integer grid."""
        return self.dynamic.get(module, (self.method.bits, self.method.group_size))


@dataclass
class LayerReport:
    name: str  # HF module name, e.g. model.layers.0.self_attn.q_proj
    shape: tuple[int, int]
    metrics: dict[str, float]
    details: dict[str, float] = field(default_factory=dict)  # the method's own numbers (GPTQ: loss, damp)


@dataclass
class BlockResult:
    layer: int  # block index, or -1 for the head
    tensors: dict[str, QuantizedTensor]  # HF module name -> quantized weight
    reports: list[LayerReport] = field(default_factory=list)
    seconds: float = 0.0
    updated: dict[str, torch.Tensor] = field(default_factory=dict)  # HF tensor name -> float32 weight that
    # replaces the source's (norms AWQ folded its scales into); writers take these over the source


@dataclass
class Progress:
    """Where a calibrated run stands between blocks: the next block (`num_layers` is the head) and its
    inputs, `x` (and the unquantized model's, `x_fp`, for GPTAQ and learned rounding). With the finished
    blocks' results it is all a killed run needs to go on with the same bytes (quant/resume.py)."""

    layer: int
    x: torch.Tensor
    x_fp: torch.Tensor | None = None


def module_name(layer: int, linear: str) -> str:
    return HEAD if layer < 0 else f"model.layers.{layer}.{linear}"


def quantized_modules(source: ModelSource, spec: QuantizeSpec) -> list[str]:
    """HF names of every module the pipeline quantizes, in the order it yields them."""
    names = [module_name(i, lin) for i in range(source.arch.num_layers) for lin in source.arch.family.linears]
    return names + ([HEAD] if spec.quantize_head else [])


def head_weight_name(source: ModelSource) -> str:
    """The tensor the LM head multiplies by: its own, or the embedding when tied."""
    return "lm_head.weight" if "lm_head.weight" in source.tensors else "model.embed_tokens.weight"


def quantize_model(source: ModelSource, spec: QuantizeSpec, tokens: torch.Tensor | None = None,
                   device: torch.device | str = "cpu", *, start: Progress | None = None,
                   on_progress: Callable[[BlockResult, Progress], None] | None = None) -> Iterator[BlockResult]:  # fmt: skip
    """Quantize every block's linears (and the head with `quantize_head`), one block at a time.

    A calibrated run reports `on_progress(result, progress)` after each block, before yielding it,
    and starts from `start` (a killed run's last progress) instead of the first block."""
    device = torch.device(device)
    method: Method = spec.method.build()
    if not spec.calibrated:
        yield from _weight_only(source, spec, method, device)
        return
    if tokens is None:
        raise ValueError(f"{method.name}{' with tuning' if spec.tune else ''} needs calibration tokens")
    yield from _calibrated(source, spec, method, tokens, device, start, on_progress or (lambda r, p: None))


def _record(result: BlockResult, name: str, w: torch.Tensor, q: Quantized) -> torch.Tensor:
    """Keep a module's result (on the CPU) and its report; returns its dequantized weight."""
    deq = q.tensor.dequantize(torch.float32)
    result.tensors[name] = q.tensor.to("cpu")
    result.reports.append(LayerReport(name, (int(w.shape[0]), int(w.shape[1])), weight_error(w, deq), q.details))
    return deq


def _weight_only(source: ModelSource, spec: QuantizeSpec, method: Method, device: torch.device) -> Iterator[BlockResult]:
    for layer in range(source.arch.num_layers):
        start = time.perf_counter()
        result = BlockResult(layer, {})
        for stage in source.arch.family.stages:
            names = [module_name(layer, lin) for lin in stage.linears]
            weights = {n: source.load(f"{n}.weight", dtype=torch.float32).to(device) for n in names}
            done = method.quantize_stage(weights, {n: spec.grid_for(n) for n in names}, None)
            for n in names:
                _record(result, n, weights[n], done[n])
        source.release_pages()
        result.seconds = time.perf_counter() - start
        yield result
    if spec.quantize_head:
        yield _head(source, spec, method, device, None)


def _head(source: ModelSource, spec: QuantizeSpec, method: Method, device: torch.device,
          stats: Collector | None) -> BlockResult:  # fmt: skip
    """The LM head (its own weight, or the tied embedding) quantized like a one-linear stage."""
    start = time.perf_counter()
    w = source.load(head_weight_name(source), dtype=torch.float32).to(device)
    result = BlockResult(-1, {})
    done = method.quantize_stage({HEAD: w}, {HEAD: spec.grid_for(HEAD)}, stats)
    _record(result, HEAD, w, done[HEAD])
    result.seconds = time.perf_counter() - start
    return result


def forward_copy(block: nn.Module, stages: tuple[Stage, ...], dtype: torch.dtype) -> nn.Module:
    """The block that carries the calibration forward: `block` itself in float32; otherwise a copy
    in `dtype`. The norms that read the float32 residual stream (the stages' non-linear producers)
    keep float32 weights and hand their output on in `dtype`; linears cast what else reaches them."""
    if dtype == torch.float32:
        return block
    run = copy.deepcopy(block)
    residual_norms = {s.producer for s in stages if not isinstance(block.get_submodule(s.producer), nn.Linear)}
    for name, module in run.named_modules():
        if name in residual_norms:
            module.register_forward_hook(lambda m, args, out: out.to(dtype))
            continue
        for p in module.parameters(recurse=False):
            p.data = p.data.to(dtype)
        if isinstance(module, nn.Linear):
            module.register_forward_pre_hook(lambda m, args: (args[0].to(m.weight.dtype), *args[1:]))
    return run


def _chunks(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


@torch.no_grad()
def _calibrated(source: ModelSource, spec: QuantizeSpec, method: Method, tokens: torch.Tensor, device: torch.device,
                start: Progress | None, on_progress: Callable[[BlockResult, Progress], None]) -> Iterator[BlockResult]:  # fmt: skip
    arch = source.arch
    if arch.family.experts is not None and method.full_precision_inputs:
        raise OptionError(f"<method> {method.name}: with its options it is not supported for mixture-of-experts "
                          f"models ({arch.family.name}); GPTQ without fp_target, AWQ and RTN are")  # fmt: skip
    if start is None:
        x = embed(source, tokens, torch.float32, device)  # [n, t, hidden]: the current block's inputs
        # the same through the unquantized model, for GPTAQ's statistics and learned rounding's targets
        x_fp = x.clone() if method.full_precision_inputs or spec.tune is not None else None
        start = Progress(0, x, x_fp)
    x, x_fp = start.x.to(device), None if start.x_fp is None else start.x_fp.to(device)
    n, t = tokens.shape
    dt = spec.act_dtype
    cos, sin = Rotary(arch).to(device)(0, t, dt)
    chunks = _chunks(n, max(1, spec.batch_size))
    for layer in range(start.layer, arch.num_layers):
        result = _calibrated_block(source, spec, method, layer, x, x_fp, chunks, cos, sin)
        on_progress(result, Progress(layer + 1, x, x_fp))
        yield result

    if spec.quantize_head and start.layer <= arch.num_layers:  # its input: the final norm of the last block's outputs
        norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, arch.family.norm_shift).to(device)
        norm.weight.data = source.load("model.norm.weight", dtype=torch.float32).to(device)
        stats = method.collector(arch.hidden_size, device)
        for s in chunks if stats is not None else ():  # (round to nearest reached here only to tune the blocks)
            stats.add(norm(x[s]), norm(x_fp[s]) if method.full_precision_inputs else None)
        result = _head(source, spec, method, device, stats)
        on_progress(result, Progress(arch.num_layers + 1, x, x_fp))
        yield result


def _calibrated_block(source: ModelSource, spec: QuantizeSpec, method: Method, layer: int, x: torch.Tensor,
                      x_fp: torch.Tensor | None, chunks: list[slice], cos: torch.Tensor,
                      sin: torch.Tensor) -> BlockResult:  # fmt: skip
    """Quantize block `layer` (by the method, or by its fallback where that leaves the lower output error),
    then tune it if asked; `x` (and `x_fp`) advance in place to its outputs."""
    start = time.perf_counter()
    fallback = getattr(method, "fallback", None)
    keep = spec.tune is not None or fallback is not None
    # what tuning fits to and the fallback is judged by: the float block's outputs, on the unquantized
    # model's inputs where those are kept (x_fp), else on this block's
    x_in, targets = (x.clone(), torch.empty_like(x)) if keep else (x, None)
    # the fallback's own copy of the unquantized model's inputs where its pass advances them (GPTAQ's stage inputs);
    # otherwise they are the float stream, the same whichever pass is kept
    x_fp_in = x_fp.clone() if fallback is not None and method.full_precision_inputs else None
    block, run, floats, result = _method_block(source, spec, method, layer, x, x_fp, chunks, cos, sin, targets)
    if fallback is not None:
        error = _output_error(x, targets)
        x_alt = x_in.clone() if spec.tune is not None else x_in  # (tuning starts from x_in again)
        alt = _method_block(source, spec, fallback, layer, x_alt, x_fp_in, chunks, cos, sin, None)
        alt_error = _output_error(x_alt, targets)
        if alt_error < error:
            block, run, floats, result = alt
            x.copy_(x_alt)
            if x_fp_in is not None:
                x_fp.copy_(x_fp_in)
        for report in result.reports:
            report.details.update(block_error=min(error, alt_error), fallback_error=alt_error, method_error=error,
                                  fallback_kept=int(alt_error < error))  # fmt: skip
        del x_alt, alt
    if spec.tune is not None:
        _tune(block, run, layer, source, spec, floats, x_in, targets, result)
        for i in range(len(chunks)):  # the block's outputs with the tuned weights
            x[chunks[i]] = run(x_in[chunks[i]], cos, sin)
    result.seconds = time.perf_counter() - start
    return result


def _output_error(out: torch.Tensor, targets: torch.Tensor) -> float:
    """Mean squared error of a block's outputs against the float block's, over every calibration token."""
    return float(sum(((out[i] - targets[i]) ** 2).mean(dtype=torch.float64) for i in range(out.shape[0])) / out.shape[0])


def _method_block(source: ModelSource, spec: QuantizeSpec, method: Method, layer: int, x: torch.Tensor,
                  x_fp: torch.Tensor | None, chunks: list[slice], cos: torch.Tensor, sin: torch.Tensor,
                  targets: torch.Tensor | None) -> tuple[nn.Module, nn.Module, dict[str, torch.Tensor], BlockResult]:  # fmt: skip
    """The method's pass over block `layer` stage by stage; `x` (and `x_fp`) advance in place to its
    outputs, `targets` (when given) is filled with the float block's (on `x_fp` when given). Returns the
    block, its forward copy, the float weights the method rounded (after any transform; kept for tuning)
    and the result."""
    stages = source.arch.family.stages
    device = x.device
    block = load_block(source, layer, torch.float32, device)  # the weights the method quantizes
    run = forward_copy(block, stages, spec.act_dtype)  # the one the forward uses
    result = BlockResult(layer, {})

    def forward(i: int) -> torch.Tensor:
        return run(x[chunks[i]], cos, sin)

    experts = source.arch.family.experts
    if targets is not None:
        for i in range(len(chunks)):
            targets[chunks[i]] = forward(i) if x_fp is None else run(x_fp[chunks[i]], cos, sin)
    if x_fp is not None and not method.full_precision_inputs:  # only the unquantized model's outputs
        for i in range(len(chunks)):
            x_fp[chunks[i]] = targets[chunks[i]] if targets is not None else run(x_fp[chunks[i]], cos, sin)
    if hasattr(method, "block_collector"):  # a method that changes the block first (AWQ)
        _transform(block, run, layer, source, spec, method, forward, len(chunks), result)
    floats = {lin: block.get_submodule(lin).weight.data.clone() for s in stages for lin in s.linears} if spec.tune else {}
    fp_inputs = _stage_inputs(run, stages, x_fp, chunks, cos, sin) if method.full_precision_inputs else None

    if not method.stage_statistics:  # rounding needs no statistics of the stages' inputs: no staged pass
        for stage in stages:
            _quantize_stage(block, run, layer, stage, spec, method, None, result)
        if experts is not None:  # the tokens each expert saw, as the method reports them (AWQ's transform)
            prefix = f"model.layers.{layer}."
            _warn_routed(layer, {r.name.removeprefix(prefix).rpartition(".")[0]: int(r.details["calibration_tokens"])
                                 for r in result.reports if r.name.startswith(f"{prefix}{experts.module}.")
                                 and "calibration_tokens" in r.details}, x.shape[-1])  # fmt: skip
        for i in range(len(chunks)):  # the block's outputs with every weight quantized
            x[chunks[i]] = forward(i)
    else:
        routed = {}  # each MoE expert: the calibration tokens routed to it
        with StagedForward(run, stages, forward, len(chunks)) as staged:
            for k, stage in enumerate(stages):
                stats, seen = None, 0
                for i, inp in staged.inputs(k):
                    if stats is None:
                        stats = method.collector(inp.shape[-1], device)
                    stats.add(inp, None if fp_inputs is None else fp_inputs[k][chunks[i]])
                    seen += inp[..., 0].numel()
                if seen == 0:  # no statistics to round with: to nearest, on the same grid
                    _quantize_stage(block, run, layer, stage, spec, ROUND_TO_NEAREST, None, result)
                else:
                    _quantize_stage(block, run, layer, stage, spec, method, stats, result)
                del stats
                if experts is not None and stage.linears[0].startswith(experts.module + "."):  # saw its routed tokens
                    routed[stage.linears[0].rpartition(".")[0]] = seen
                    for report in result.reports[-len(stage.linears):]:
                        report.details.update(routed_tokens=seen, **({"rtn_fallback": 1} if seen == 0 else {}))
            for i, out in staged.outputs():  # the block's outputs with every weight quantized
                x[chunks[i]] = out
        _warn_routed(layer, routed, x.shape[-1])
    return block, run, floats, result


def _tune(block: nn.Module, run: nn.Module, layer: int, source: ModelSource, spec: QuantizeSpec,
          floats: dict[str, torch.Tensor], x_in: torch.Tensor, targets: torch.Tensor, result: BlockResult) -> None:  # fmt: skip
    """Learned rounding of the block's linears on evenly spaced or levelled grids from the method's results
    (quant/tune.py); the tuned codes replace the results, their reports and the weights of the block and its
    forward copy."""
    prefix = f"model.layers.{layer}."
    device = x_in.device
    grids = {name.removeprefix(prefix): spec.grid_for(name) for name in result.tensors if name.startswith(prefix)}
    start = {lin: result.tensors[prefix + lin].to(device) for lin, grid in grids.items() if tunable(grid)}
    if not start:
        return
    levels = {lin: getattr(grids[lin], "code_levels", None) for lin in start}
    cos, sin = Rotary(source.arch).to(device)(0, x_in.shape[1], torch.float32)
    tuned, details = tune_block(block, floats, start, block_forward(x_in, cos, sin), targets, spec.tune, layer, levels)
    reports = {r.name: r for r in result.reports}
    for lin, qt in tuned.items():
        name = prefix + lin
        deq = qt.dequantize(torch.float32)
        result.tensors[name] = qt.to("cpu")
        reports[name].metrics = weight_error(floats[lin], deq)
        reports[name].details.update(details)
        for module in {block.get_submodule(lin), run.get_submodule(lin)}:
            module.weight.data = deq.to(module.weight.dtype)


ROUND_TO_NEAREST = RTN(RTNConfig())  # rounds onto each module's own grid (the config's grid is not used)


def _warn_routed(layer: int, routed: dict[str, int], width: int) -> None:
    """The rule for MoE experts, which see only the calibration tokens routed to them: an expert no
    token reached is rounded to nearest (a method's statistics are empty); one that saw fewer tokens
    than the hidden width is quantized from a rank-deficient Hessian (GPTQ leans on its damping there).
    Both are named in one warning per layer. `routed`: each expert's module -> its tokens."""
    none = [m for m, n in routed.items() if n == 0]
    few = [f"{m} ({n})" for m, n in routed.items() if 0 < n < width]
    parts = ([f"no routed calibration tokens, rounded to nearest (RTN): {', '.join(none)}"] if none else []) + (
        [f"fewer routed tokens than the hidden width {width}: {', '.join(few)}"] if few else [])
    if parts:
        log.warning("layer %d experts with %s", layer, "; ".join(parts))


def _transform(block: nn.Module, run: nn.Module, layer: int, source: ModelSource, spec: QuantizeSpec,
               method: Method, forward: Callable[[int], torch.Tensor], n: int, result: BlockResult) -> None:  # fmt: skip
    """Gather every stage's input statistics over the unquantized block, let the method change the
    block (float32 weights, then its forward copy), and record the non-linear tensors it changed."""
    family = source.arch.family
    stats: list = [None] * len(family.stages)
    with StagedForward(run, family.stages, forward, n) as staged:  # closing unwinds the rest of the forward
        for k in range(len(family.stages)):
            for _, inp in staged.inputs(k):
                if stats[k] is None:
                    stats[k] = method.block_collector(inp.shape[-1], inp.device)
                stats[k].add(inp)
    readers = family.experts.readers() if family.experts is not None else {}
    access = BlockAccess(layer, block, family.stages, stats, spec.grid_for, family.score_linears, readers)
    changes = method.transform_block(access)
    if run is not block:
        for (_, mine), (_, master) in zip(run.named_parameters(), block.named_parameters()):
            mine.data = master.data.to(mine.dtype)
    quantized = {lin for stage in family.stages for lin in stage.linears}
    for module in sorted(changes.modules):
        for pname, p in block.get_submodule(module).named_parameters():
            if module in quantized and pname == "weight":  # written from the method's codes, not as a float
                continue
            result.updated[f"model.layers.{layer}.{module}.{pname}"] = p.data.detach().to("cpu", torch.float32).clone()


def _stage_inputs(run: nn.Module, stages: tuple[Stage, ...], x_fp: torch.Tensor, chunks: list[slice],
                  cos: torch.Tensor, sin: torch.Tensor) -> list[torch.Tensor]:  # fmt: skip
    """What each stage receives in the full-precision model (the block still unquantized); `x_fp` is
    advanced in place to the block's full-precision outputs."""
    n, t, _ = x_fp.shape
    inputs: list[torch.Tensor] = []

    def forward(i: int) -> torch.Tensor:
        return run(x_fp[chunks[i]], cos, sin)

    with StagedForward(run, stages, forward, len(chunks)) as staged:
        for k in range(len(stages)):
            for i, inp in staged.inputs(k):
                if i == 0:
                    inputs.append(torch.empty(n, t, inp.shape[-1], dtype=inp.dtype, device=inp.device))
                inputs[k][chunks[i]] = inp
        for i, out in staged.outputs():
            x_fp[chunks[i]] = out
    return inputs


def _quantize_stage(block: nn.Module, run: nn.Module, layer: int, stage: Stage, spec: QuantizeSpec, method: Method,
                    stats, result: BlockResult) -> None:  # noqa: ANN001 - the method's collector
    """Quantize one stage's linears, then put the quantized weights into `block` and its forward copy."""
    names = {module_name(layer, lin): lin for lin in stage.linears}
    weights = {n: block.get_submodule(lin).weight.data for n, lin in names.items()}
    done = method.quantize_stage(weights, {n: spec.grid_for(n) for n in names}, stats)
    for n, lin in names.items():
        deq = _record(result, n, weights[n], done[n])
        module = block.get_submodule(lin)
        module.weight.data = deq.to(module.weight.dtype)
        if run is not block:
            copy_weight = run.get_submodule(lin).weight
            copy_weight.data = deq.to(copy_weight.dtype)
