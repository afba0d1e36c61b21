"""What a calibrated command holds in memory, one decoder block at a time, and how long a block takes.

The calibrated commands stream the model a block at a time (quant/pipeline.py for `quantize` and
`convert --method`, calibration/imatrix.py for `imatrix`), so what must fit is one block's working
set, not the model. This module counts that working set from the architecture's tensor shapes
alone (no torch: the same numbers for a model on disk, a preset or a hub config), the way the code
holds it:

- the block read in float32, and the forward copy in the calibration dtype the pipeline makes of it
  when that dtype is not float32 (`pipeline.forward_copy`);
- the calibration activations: the residual stream of every sample, float32 [n, t, hidden]; GPTAQ
  keeps the full-precision model's too, and every stage's full-precision input (`_stage_inputs`);
- what the block's forward holds while it is paused at a stage: `StagedForward` stops every chunk's
  forward at the stage being quantized, so each token's residual, its norm output and the stage's
  input stay alive for all samples at once (at the MLP's down projection: hidden x 4 + hidden x a +
  FFN x a bytes per token, a the calibration dtype's width), plus one chunk's forward temporaries;
- the method's statistics: GPTQ's float32 Hessian [in, in] of the stage, with its working copies
  (`HessianAccumulator.value()` mirrors it in place, `gptq_quantize` clones it, and the damped
  matrix, its Cholesky factor, the inverse and the inverse's factor exist in turn, each dropped once
  the next exists: four [in, in] float32 matrices at the peak; GPTAQ's cross term and its clone two
  more, refit_scales' copy one more), and the stage's weights stacked, cloned and coded; AWQ holds every stage's Hessian
  at once while its forward is paused, then each Hessian twice (read, and rescaled) during its
  search, with a few weight-sized temporaries per candidate;
- the block's codes until the writer has them, and the writer's packed copy;
- apart from the block, two steps that load a whole [vocab, hidden] tensor: the embedding table
  (read whole to embed the calibration tokens, `calibration/capture.embed`) and, with
  `quantize_head`, the LM head quantized like a stage.

`imatrix` holds the block in float32, the hidden states of every chunk twice (the next block's are
concatenated while the current ones are alive) and one chunk's forward. The automatic mix's Fisher
pass (plan/fisher.py: forward block by block keeping each block's input, in memory up to a budget and
then on disk; backward block by block recomputing each block) holds one block in float32 with its
gradients and Fisher diagonals, one sample's activations for the backward, the gradient at one block
boundary for every sample and the kept inputs; its head step holds the head in its stored dtype with
its diagonal, and one sample's logits [t, vocab] float32 with their gradient. `eval` of two models streamed holds two blocks and two
sets of window activations, and the heads' logits per batch.

`benchmarks/time_model.py` measures a command's peak RSS at small shapes beside this model's
prediction. The time model is below (`block_seconds`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from llmopt.model.arch import ArchSpec

F32 = 4
GB = 1e9
STRIP = 256  # calibration/hessian.py's strip of the Hessian's upper triangle (its cost, below)
GPTQ_BLOCK = 128  # gptq.py's lazy-update block of columns
# float32 copies of every linear weight while a block is tuned: the weight, the method's offsets, the learned
# offsets, their gradient and best state, and what autograd keeps of ŵ's arithmetic. Measured at the Llama-3.1-8B
# block (benchmarks/tune_memory.py, 4 x 256 tokens, 2 per step): peak 10,205 MiB anonymous against 9,652 modeled
# with 10 copies; 11 covers it
TUNE_COPIES = 11
HESSIAN_COPIES = 4  # [in, in] float32 matrices alive at once in one GPTQ stage (see the module docstring)


@dataclass(frozen=True)
class StageShape:
    width: int  # the stage's input features
    rows: int  # output rows of its linears together
    linears: int


@dataclass(frozen=True)
class BlockShape:
    """The shapes of one decoder block that its working set depends on (the largest block's)."""

    params: int  # every tensor of the block
    linear_params: int
    stages: tuple[StageShape, ...]
    hidden: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int

    @staticmethod
    def of(arch: ArchSpec) -> BlockShape:
        family = arch.family
        best: tuple[int, dict[str, tuple[int, ...]]] = (-1, {})
        for layer in range(arch.num_layers):
            shapes = block_tensor_shapes(arch, layer)
            total = sum(math.prod(s) for s in shapes.values())
            if total > best[0]:
                best = (total, shapes)
        total, shapes = best
        stages = []
        for stage in family.stages:
            linear = [shapes[f"{name}.weight"] for name in stage.linears if f"{name}.weight" in shapes]
            if linear:
                stages.append(StageShape(linear[0][-1], sum(s[0] for s in linear), len(linear)))
        linear_params = sum(s.width * s.rows for s in stages)
        return BlockShape(total, linear_params, tuple(stages), arch.hidden_size, arch.vocab_size, arch.num_heads,
                          arch.num_kv_heads, arch.head_dim, arch.num_layers)  # fmt: skip

    @property
    def widest(self) -> StageShape:
        return max(self.stages, key=lambda s: s.width)


def block_tensor_shapes(arch: ArchSpec, layer: int) -> dict[str, tuple[int, ...]]:
    """Block-relative name -> shape of every tensor of block `layer` as the pipeline sees it: a fused
    linear (Phi-3's qkv_proj) and an expert stack as the linears they hold."""
    family = arch.family
    prefix = f"model.layers.{layer}."
    out: dict[str, tuple[int, ...]] = {}
    for hf_name, _, shape, _ in family.tensor_shapes(arch, layer):
        parts = family.split(arch, hf_name) if hf_name.endswith((".weight", ".bias")) else None
        if not parts:
            out[hf_name.removeprefix(prefix)] = shape
            continue
        row = shape[1:] if len(shape) < 3 else shape[2:]
        for part, lo, hi in parts:
            out[part.removeprefix(prefix)] = (hi - lo, *row)
    return out


@dataclass(frozen=True)
class Workload:
    """What a command runs over: its method, its calibration tokens and their dtype's width."""

    command: str  # "quantize" (and `convert --method`), "imatrix", "sensitivity", "eval"
    method: str = "gptq"  # gptq, awq, awq+gptq, rtn (quantize)
    samples: int = 128  # calibration samples (imatrix: chunks; sensitivity: its samples; eval: windows)
    seqlen: int = 512  # tokens per sample
    act_bytes: int = F32  # the calibration forward's dtype width (bfloat16: 2)
    batch: int = 8  # samples per forward chunk
    gptaq: bool = False  # GPTQ's full-precision inputs (GPTAQ)
    refit_scales: bool = False
    quantize_head: bool = False
    bits: int = 4
    kept_bytes: int = 0  # sensitivity: block inputs its forward keeps in memory before spilling to disk
    self_written: bool = False  # calibration text written by the model itself (`--calib self`): the whole model runs
    tune_iters: int = 0  # learned rounding's steps per block (quant/tune.py), each over `batch` samples

    @property
    def tokens(self) -> int:
        return self.samples * self.seqlen


@dataclass(frozen=True)
class Footprint:
    """The resident bytes of a command's largest step: its parts, and the steps apart from the blocks."""

    workload: Workload
    parts: tuple[tuple[str, int], ...]  # (what, bytes) of one block's step
    steps: dict[str, int] = field(default_factory=dict)  # other whole-tensor steps: name -> bytes

    @property
    def block_bytes(self) -> int:
        return sum(n for _, n in self.parts)

    @property
    def peak(self) -> int:
        return max([self.block_bytes, *self.steps.values()])

    @property
    def peak_step(self) -> str:
        """The step that needs the most: "one block" or the name of a whole-tensor step."""
        step = max(self.steps.items(), key=lambda kv: kv[1], default=("", -1))
        return step[0] if step[1] > self.block_bytes else "one block"

    def summary(self) -> str:
        """"9.1 GB (block 3.4 GB, Hessians 2.5 GB, calibration 1.1 GB for 128 x 512 tokens)"."""
        w = self.workload
        shown = sorted((p for p in self.parts if p[1] >= 0.005 * self.block_bytes), key=lambda p: -p[1])
        inner = ", ".join(f"{what} {gb(n)}" for what, n in shown)
        tokens = f" for {w.samples} x {w.seqlen} tokens" if w.command != "quantize" or w.method != "rtn" or w.tune_iters else ""
        return f"{gb(self.block_bytes)} ({inner}{tokens})"

    def to_dict(self) -> dict:
        return {"peak_bytes": self.peak, "peak_step": self.peak_step, "block_bytes": self.block_bytes,
                "parts": dict(self.parts), "steps": dict(self.steps)}  # fmt: skip


def gb(n: float) -> str:
    return f"{n / GB:.1f} GB" if n >= 0.095 * GB else f"{n / 2**20:.1f} MiB"


# ------------------------------------------------------------------------------------------ memory
def footprint(arch: ArchSpec | BlockShape, work: Workload) -> Footprint:
    """The working set of `work` on a model of this architecture (see the module docstring)."""
    shape = arch if isinstance(arch, BlockShape) else BlockShape.of(arch)
    make = {"quantize": _quantize, "imatrix": _imatrix, "sensitivity": _sensitivity, "eval": _eval}
    if work.command not in make:
        raise ValueError(f"no footprint model for {work.command!r}")
    fp = make[work.command](shape, work)
    if work.self_written:  # generation holds the whole model at the calibration dtype (calibration/self_text.py)
        whole = shape.layers * shape.params + 2 * shape.vocab * shape.hidden  # an untied head: the upper bound
        fp.steps[SELF_WRITTEN] = whole * work.act_bytes
    return fp


SELF_WRITTEN = "self-written calibration"  # the step that writes `--calib self` text with the whole model


def _codes(b: BlockShape, work: Workload) -> int:
    """One block's codes (uint8 per weight) until written, and the writer's packed copy."""
    return b.linear_params + b.linear_params * work.bits // 8


def _embedding_step(b: BlockShape, work: Workload) -> int:
    """The table read whole in its stored dtype (16-bit; its file pages until released) and the embedded tokens."""
    return b.vocab * b.hidden * 2 * 2 + 2 * work.tokens * b.hidden * F32


def _held(b: BlockShape, work: Workload) -> int:
    """Every sample's forward paused at the widest stage, and one chunk's forward temporaries."""
    a, t = work.act_bytes, work.tokens
    paused = t * (b.hidden * (F32 + a) + b.widest.width * a)
    chunk = work.batch * work.seqlen * (3 * b.widest.width * a + 2 * b.heads * b.head_dim * a + b.hidden * F32)
    return paused + chunk


def _gptq_stage(b: BlockShape, work: Workload, stage: StageShape) -> tuple[int, int]:
    """(Hessians, weights) of one GPTQ stage at its peak."""
    copies = HESSIAN_COPIES + (2 if work.gptaq else 0) + (1 if work.refit_scales else 0)
    weights = stage.rows * stage.width * (F32 * (3 if stage.linears > 1 else 2) + 1)
    return copies * stage.width**2 * F32, weights


def _awq(b: BlockShape, work: Workload) -> tuple[int, int]:
    """(statistics while paused, search working set) of AWQ's transform."""
    hessians = sum(s.width**2 for s in b.stages) * F32
    weights = max(s.rows * s.width for s in b.stages) * F32
    return hessians, 2 * hessians + 5 * weights


def _quantize(b: BlockShape, work: Workload) -> Footprint:
    block = b.params * F32
    if work.method == "rtn" and not work.tune_iters:
        stage = max(b.stages, key=lambda s: s.rows * s.width)
        parts = (("weights", stage.rows * stage.width * F32 * 3), ("writer", _codes(b, work)))
        steps = {"LM head": b.vocab * b.hidden * (3 * F32 + 1)} if work.quantize_head else {}
        return Footprint(work, parts, steps)
    copy = b.params * work.act_bytes if work.act_bytes != F32 else 0
    # the residual stream `x`, and the unquantized model's beside it for GPTAQ and for learned rounding's targets
    calib = work.tokens * b.hidden * F32 * (2 if work.gptaq or work.tune_iters else 1)
    if work.gptaq:
        calib += work.tokens * sum(s.width for s in b.stages) * work.act_bytes
    held = _held(b, work)
    phases = [(held, 0, 0)]  # (activations, statistics, weights) at each step of a block: the largest counts
    if work.method in ("gptq", "awq+gptq"):
        phases += [(held, *_gptq_stage(b, work, s)) for s in b.stages]
    if work.method in ("awq", "awq+gptq"):
        paused, search = _awq(b, work)
        phases += [(held, paused, 0), (0, search, 0)]  # statistics beside the paused forward; then its search
    fallback = work.method == "awq+gptq"  # GPTQ alone on the same block too: a second block
    if fallback:
        block *= 2
    # beside `x`, for tuning and the fallback: the block's inputs and the float outputs (and the fallback's own
    # copy of the inputs when both run)
    calib += (2 * (fallback or work.tune_iters > 0) + (fallback and work.tune_iters > 0)) * work.tokens * b.hidden * F32
    if work.tune_iters:  # a batch's graph and the offsets
        phases.append((work.batch * _sample_activations(b, work.seqlen), 0, TUNE_COPIES * b.linear_params * F32))
    held, stats, weights = max(phases, key=sum)
    parts = (("block", block + copy), ("Hessians", stats), ("activations", held), ("weights", weights),
             ("calibration", calib), ("writer", _codes(b, work)))  # fmt: skip
    steps = {"embedding": _embedding_step(b, work)}
    if work.quantize_head:
        steps["LM head"] = calib + b.vocab * b.hidden * (3 * F32 + 1) + HESSIAN_COPIES * b.hidden**2 * F32
    return Footprint(work, parts, steps)


def _imatrix(b: BlockShape, work: Workload) -> Footprint:
    one = work.seqlen * (3 * b.widest.width + 2 * b.heads * b.head_dim + 2 * b.hidden) * F32
    sums = sum(s.width for s in b.stages) * 8
    parts = (("block", b.params * F32), ("calibration", 2 * work.tokens * b.hidden * F32), ("activations", one + sums))
    return Footprint(work, parts, {"embedding": _embedding_step(b, work)})


def _sample_activations(b: BlockShape, seqlen: int) -> int:
    """What autograd keeps of one block's forward over one sample (float32), for its backward."""
    per_token = 4 * b.hidden + 2 * (b.heads + 2 * b.kv_heads) * b.head_dim + 3 * b.widest.width
    return seqlen * per_token * F32


def _sensitivity(b: BlockShape, work: Workload) -> Footprint:
    grads = work.tokens * b.hidden * F32  # the gradient at one block boundary, for every sample
    kept = min(work.kept_bytes, (b.layers + 1) * grads)  # block inputs the forward keeps in memory (the rest on disk)
    parts = (("block + gradients + Fisher", 3 * b.params * F32), ("activations", _sample_activations(b, work.seqlen)),
             ("calibration", 2 * grads + kept))  # fmt: skip
    head = b.vocab * b.hidden * (2 + F32) + 2 * work.seqlen * b.vocab * F32 + grads + kept
    return Footprint(work, parts, {"LM head": head, "embedding": _embedding_step(b, work)})


def _eval(b: BlockShape, work: Workload) -> Footprint:
    windows = 2 * work.tokens * b.hidden * F32  # both models' activations of every window
    parts = (("2 blocks", 2 * b.params * F32), ("calibration", windows),
             ("activations", 2 * work.batch * work.seqlen * 3 * b.widest.width * F32))  # fmt: skip
    head = 2 * b.vocab * b.hidden * F32 + 3 * work.batch * work.seqlen * b.vocab * F32
    return Footprint(work, parts, {"LM head": head, "embedding": _embedding_step(b, work)})


def check_fits(fp: Footprint, available: int, where: str, levers: str) -> None:
    """Refuse before any work when the largest step cannot fit: one line naming what it needs, what
    is available and what lowers it (`levers`, e.g. "lower <nsamples>/<seqlen>")."""
    if fp.peak <= available:
        return
    from llmopt.errors import OptionError

    step = fp.peak_step
    if step == SELF_WRITTEN:  # the whole model generates: only another calibration source avoids it
        need = f"writing calibration text with the model itself (<calib> self) holds all of it: {gb(fp.steps[step])}"
        levers = "give <calib> a text file"
    elif step == "one block":
        need = f"one block of this model needs {fp.summary()}"
    else:
        need = (f"the {step} step of this model needs {gb(fp.steps[step])} (the {step} tensor loaded whole, then "
                f"one block {gb(fp.block_bytes)})")  # fmt: skip
    source = "" if where == "available" else f" ({where})"
    raise OptionError(f"{need}; {gb(available)} is available{source}: {levers} or free memory")


# -------------------------------------------------------------------------------------------- time
@dataclass(frozen=True)
class Efficiency:
    """A command's speed here: the fraction of the matmul peak its FLOPs reach, and GPTQ's cost per
    column (its column loop runs a few small operations per input column, whatever the width)."""

    fraction: float
    per_column: float = 0.0  # seconds per GPTQ column


# Measured at the size people run: benchmarks/scale.py on the Llama-3.1-8B shape (random bf16, 8 x 256
# calibration tokens), each fraction against the matmul rate the same run measured (see MEASURED).
# At 8B the matmuls dominate, so GPTQ's column loop is inside the fraction (per_column 0); the small
# widths of benchmarks/time_model.py give lower fractions (latency-bound), not the ones to project with.
EFFICIENCY: dict[str, Efficiency] = {
    "imatrix": Efficiency(0.237),  # 32 layers, 19.0 s per block
    "gptq": Efficiency(0.307),  # quantize --method gptq, 1 layer: the pipeline's own 117.8 s per block
    "awq+gptq": Efficiency(0.45),  # convert --type Q4_K_M --method awq+gptq, 1 layer: 502 s wall
    "sensitivity": Efficiency(0.20),  # the automatic mix's Fisher pass: 52.0 s per block (1 vs 2 layers)
    "awq": Efficiency(0.60),  # quantize --method awq, 1 layer: the pipeline's own 277.0 s per block
    # learned rounding's steps (tune_flops), on top of its method: SmolLM2 off-grid, gptq w2 g64 --iters 40, 32 x 256
    # samples, 4 per step: ~27 s per block beyond GPTQ's against a 69 GFLOP/s matmul rate (benchmarks/tune.py)
    "tune": Efficiency(0.6),
}
MEASURED = "benchmarks/scale.py, Llama-3.1-8B shape, 8 x 256 tokens, 2-core x86 (see docs/big-models.md)"


def forward_flops(b: BlockShape, work: Workload) -> float:
    """One block's forward over the calibration tokens: its linears and causal attention."""
    attention = 2.0 * b.heads * b.head_dim * work.seqlen**2 * work.samples
    return 2.0 * b.linear_params * work.tokens + attention


def hessian_flops(s: StageShape, tokens: int) -> float:
    """The upper block triangle of 2/N XᵀX, strip by strip (calibration/hessian.py)."""
    return float(tokens) * s.width * (s.width + STRIP)


def gptq_flops(s: StageShape) -> float:
    """GPTQ's solve of one stage: the inverse Hessian's factors (~4/3 in³) and the column updates."""
    return 4.0 / 3.0 * s.width**3 + 2.0 * s.rows * s.width * (s.width / 2 + GPTQ_BLOCK)


def awq_flops(b: BlockShape, work: Workload, n_grid: int = 20, clips: int = 10, group: int = 128) -> float:
    """AWQ's scale search (n_grid candidates: ΔW H per linear) and clip search (per group blocks)."""
    return sum(n_grid * 2.0 * s.rows * s.width**2 + clips * 2.0 * s.rows * s.width * group for s in b.stages)


def block_work(b: BlockShape, work: Workload) -> tuple[float, int]:
    """(FLOPs, GPTQ columns) of one block of `work`."""
    method = work.method if work.command == "quantize" else work.command
    fwd = forward_flops(b, work)
    hessians = sum(hessian_flops(s, work.tokens) for s in b.stages)
    gptq = sum(gptq_flops(s) for s in b.stages)
    columns = sum(s.width for s in b.stages)
    if method == "gptq":
        return fwd * (2 if work.gptaq else 1) + hessians * (2 if work.gptaq else 1) + gptq, columns
    if method == "awq":
        return 2 * fwd + hessians + awq_flops(b, work), 0
    if method == "awq+gptq":  # and GPTQ alone on the same block (its fallback), judged against the float outputs
        return 3 * fwd + 3 * hessians + awq_flops(b, work) + 2 * gptq, 2 * columns
    if method == "rtn":
        return 20.0 * b.linear_params, 0
    if method == "imatrix":
        return fwd, 0
    if method == "sensitivity":
        return 3.5 * fwd + 20.0 * 8 * b.linear_params, 0  # ~8 candidate types per tensor
    if method == "eval":
        return 2 * fwd, 0
    raise ValueError(f"no time model for {method!r}")


def efficiency(work: Workload) -> Efficiency | None:
    method = work.method if work.command == "quantize" else work.command
    return EFFICIENCY.get(method)


def block_seconds(b: BlockShape, work: Workload, peak_flops: float, eff: Efficiency | None = None) -> float | None:
    """Seconds per block at a device's matmul peak (FLOP/s), or None where no efficiency is measured."""
    eff = eff or efficiency(work)
    if eff is None and not (work.tune_iters and work.method == "rtn"):  # (rounding to nearest itself is negligible)
        return None
    flops, columns = block_work(b, work)
    seconds = 0.0 if eff is None else flops / (eff.fraction * peak_flops) + columns * eff.per_column
    return seconds + tune_flops(b, work) / (EFFICIENCY["tune"].fraction * peak_flops) if work.tune_iters else seconds


def tune_flops(b: BlockShape, work: Workload) -> float:
    """Learned rounding of one block: each step a forward and a backward (~3 forwards) over `batch`
    samples; around the steps, four forwards over every sample (the float targets, the error before
    and after, the tuned outputs)."""
    step = forward_flops(b, Workload(work.command, samples=min(work.batch, work.samples), seqlen=work.seqlen))
    return 3.0 * step * work.tune_iters + 4.0 * forward_flops(b, work)
