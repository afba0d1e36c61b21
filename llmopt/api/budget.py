"""Memory and time of a streamed command before it starts: the refusal when one block cannot fit, and
the plan `--dry-run` prints. Both read the same models (`llmopt.plan.footprint`), so what a dry run
shows is what the check compares.

A command lists the passes it will run as `Workload`s (quantize: the pipeline, and the automatic
mix's Fisher pass with a target; imatrix: its one pass), and calls `check_memory` where its work is
prepared, before any calibration text is generated or any block is read.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from typing import Any

import torch

from llmopt.calibration.activations import DEFAULT_BUDGET
from llmopt.calibration.samples import CalibConfig
from llmopt.calibration.text import SELF
from llmopt.memory import memory_budget
from llmopt.model.arch import ArchSpec
from llmopt.plan.footprint import BlockShape, Footprint, Workload, block_seconds, check_fits, footprint
from llmopt.plan.gpus import GPUS
from llmopt.quant.pipeline import QuantizeSpec

# What lowers each pass's footprint, as the refusal names it (options as <field>: the CLI shows flags)
LEVERS = {"quantize": "lower <nsamples>/<seqlen>", "imatrix": "lower <chunks>/<ctx_size>",
          "sensitivity": "lower <sensitivity_samples>/<seqlen>"}  # fmt: skip


def pipeline_workload(spec: QuantizeSpec, calibration: CalibConfig | None) -> Workload:
    """The quantization pipeline's pass (quantize, convert --method) as the models read it."""
    m = spec.method
    gptq = m if m.name == "gptq" else getattr(m, "gptq", None)
    n, t = (calibration.nsamples, calibration.seqlen) if calibration is not None else (0, 0)
    return Workload("quantize", m.name, n, t, spec.act_dtype.itemsize, spec.batch_size,
                    gptaq=bool(gptq is not None and gptq.fp_target > 0),
                    refit_scales=bool(gptq is not None and gptq.refit_scales), quantize_head=spec.quantize_head,
                    bits=m.bits, self_written=calibration is not None and calibration.source == SELF,
                    tune_iters=spec.tune.iters if spec.tune is not None else 0)  # fmt: skip


def sensitivity_workload(calibration: CalibConfig) -> Workload:
    """The automatic mix's Fisher pass over its calibration samples (block inputs kept in memory up to
    the activation store's budget, the rest on disk)."""
    return Workload("sensitivity", samples=calibration.nsamples, seqlen=calibration.seqlen, kept_bytes=DEFAULT_BUDGET,
                    self_written=calibration.source == SELF)  # fmt: skip


def check_memory(arch: ArchSpec, works: Sequence[Workload]) -> list[Footprint]:
    """Each pass's footprint; a one-line OptionError (exit 2) when one cannot fit in the memory available."""
    available, where = memory_budget()
    shape = BlockShape.of(arch)
    prints = [footprint(shape, w) for w in works]
    for fp in prints:
        check_fits(fp, available, where, LEVERS[fp.workload.command])
    return prints


@functools.cache
def matmul_flops() -> float:
    """This machine's float32 matrix-multiply rate (FLOP/s), measured once: what the time model's
    efficiencies are fractions of (benchmarks/time_model.py measures them against the same number)."""
    n = 1024
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm up
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2.0 * n**3 / best


# The GPU a dry run also projects to: the same FLOPs at its dense bf16 peak and this machine's fraction
# (a lower bound: GPTQ's column loop and the transfers of each block are latency, not arithmetic)
PROJECTED_GPU = GPUS["h100-80g"]


def dry_run(arch: ArchSpec, works: Sequence[Workload]) -> dict[str, Any]:
    """What each pass would hold and take, for `--dry-run`: the same footprints the refusal compares."""
    available, where = memory_budget()
    shape = BlockShape.of(arch)
    passes = []
    for w in works:
        fp = footprint(shape, w)
        per_block = block_seconds(shape, w, matmul_flops())
        on_gpu = block_seconds(shape, w, PROJECTED_GPU.bf16_tflops * 1e12)
        name = w.method if w.command == "quantize" else w.command
        passes.append({"pass": name, "blocks": arch.num_layers, "samples": w.samples, "seqlen": w.seqlen,
                       "calibration_tokens": w.tokens, "memory": fp.summary(), "footprint": fp.to_dict(),
                       "fits": fp.peak <= available, "seconds_per_block": per_block,
                       "seconds": None if per_block is None else per_block * arch.num_layers,
                       "gpu": PROJECTED_GPU.name, "gpu_seconds": None if on_gpu is None else on_gpu * arch.num_layers})  # fmt: skip
    return {"available_bytes": available, "available_from": where, "passes": passes}
