"""The footprint and time models' predictions for Llama-3.1-8B and -70B, as the tables of docs/big-models.md.

The tables in the doc are this script's output, so that they change when the models do (e.g. GPTQ's
Hessian copies): memory is `llmopt/plan/footprint.footprint()` on the presets, no measurement; time
is `block_seconds()` with the fractions measured at the 8B shape (footprint.EFFICIENCY) at this
machine's matmul rate (measured now, as `--dry-run` does) and at an H100's bf16 peak.

Usage: python benchmarks/footprint_table.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmopt.api.budget import PROJECTED_GPU, matmul_flops  # noqa: E402
from llmopt.calibration.activations import DEFAULT_BUDGET  # noqa: E402
from llmopt.cli.quantize import duration  # noqa: E402
from llmopt.plan.footprint import BlockShape, Workload, block_seconds, footprint, gb  # noqa: E402
from llmopt.plan.presets import PRESETS  # noqa: E402

BF16 = 2
ROWS: tuple[tuple[str, Workload], ...] = (
    ("quantize gptq, 128 x 512", Workload("quantize", "gptq", 128, 512, act_bytes=BF16)),
    ("quantize gptq, float32 forward", Workload("quantize", "gptq", 128, 512)),
    ("quantize awq", Workload("quantize", "awq", 128, 512, act_bytes=BF16)),
    ("quantize awq+gptq", Workload("quantize", "awq+gptq", 128, 512, act_bytes=BF16)),
    ("quantize rtn", Workload("quantize", "rtn")),
    ("imatrix, 128 x 512", Workload("imatrix", samples=128, seqlen=512)),
    ("automatic mix, 32 x 512", Workload("sensitivity", samples=32, seqlen=512, kept_bytes=DEFAULT_BUDGET)),
    ("eval of two models, 40 x 512", Workload("eval", samples=40, seqlen=512)),
)


def table(models: tuple[str, ...] = ("llama-3.1-8b", "llama-3.1-70b")) -> str:
    lines = ["| model | command | one block | largest parts | whole-tensor step |", "|---|---|---|---|---|"]
    for key in models:
        for label, work in ROWS:
            fp = footprint(PRESETS[key].arch, work)
            parts = sorted(fp.parts, key=lambda p: -p[1])[:2]
            largest = ", ".join(f"{what} {gb(n)}" for what, n in parts)
            steps = ", ".join(f"{name} {gb(n)}" for name, n in fp.steps.items()) or "-"
            lines.append(f"| {PRESETS[key].name} | {label} | {gb(fp.block_bytes)} | {largest} | {steps} |")
    return "\n".join(lines)


def time_table(models: tuple[str, ...] = ("llama-3.1-8b", "llama-3.1-70b")) -> str:
    """Seconds per block and in all, here and on the projected GPU, where a fraction is measured."""
    here = matmul_flops()
    gpu = PROJECTED_GPU.bf16_tflops * 1e12
    lines = [f"| model | command | per block here | all blocks here | all blocks, {PROJECTED_GPU.name} (at least) |",
             "|---|---|---|---|---|"]  # fmt: skip
    for key in models:
        arch = PRESETS[key].arch
        for label, work in ROWS:
            shape = BlockShape.of(arch)
            cpu = block_seconds(shape, work, here)
            if cpu is None:
                continue
            total_gpu = block_seconds(shape, work, gpu) * arch.num_layers
            lines.append(f"| {PRESETS[key].name} | {label} | {cpu:.0f} s | {duration(cpu * arch.num_layers)} "
                         f"| {duration(total_gpu)} |")  # fmt: skip
    return f"this machine's float32 matmul rate: {here / 1e9:.1f} GFLOP/s\n\n" + "\n".join(lines)


if __name__ == "__main__":
    print(table())
    print()
    print(time_table())
