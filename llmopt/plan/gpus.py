"""A catalog of accelerators: memory, bandwidth and dense peak compute, for rooflines and budgets.

Numbers are vendor datasheet values without structured sparsity (NVIDIA quotes sparse peaks as
"2x"; we keep the dense half). Memory is the marketed capacity in GiB, which is what the driver
reports for these cards (an "80 GB" A100 shows 81920 MiB), except the H200, whose 141 GB is
decimal (143771 MiB in nvidia-smi).
"""

from __future__ import annotations

from dataclasses import dataclass

from llmopt.errors import InputError

GIB = 2**30


@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: int
    bandwidth_gbs: float  # memory bandwidth, GB/s (10^9 bytes per second)
    bf16_tflops: float  # dense tensor-core peak, 10^12 FLOP/s
    int8_tops: float  # dense tensor-core peak, 10^12 OP/s
    source: str


_GPUS = (
    # NVIDIA A10G (AWS G5): same 24 GB / 600 GB/s as the A10, lower tensor clocks; Baseten's
    # "NVIDIA A10 vs A10G" comparison of the two spec sheets.
    GPU("a10g", 24 * GIB, 600, 70, 140, "NVIDIA A10G spec sheet (AWS G5)"),
    GPU("l4", 24 * GIB, 300, 121, 242.5, "NVIDIA L4 datasheet"),
    GPU("l40s", 48 * GIB, 864, 362.05, 733, "NVIDIA L40S datasheet"),
    # GeForce cards: BF16 with FP32 accumulate (what inference kernels use) runs at half the
    # FP16-accumulate rate; Ampere GA102 and Ada AD102 whitepapers.
    GPU("rtx-3090", 24 * GIB, 936, 71, 284, "NVIDIA Ampere GA102 whitepaper"),
    GPU("rtx-4090", 24 * GIB, 1008, 165.2, 660.6, "NVIDIA Ada Lovelace AD102 whitepaper"),
    GPU("a100-40g", 40 * GIB, 1555, 312, 624, "NVIDIA A100 datasheet (SXM4 40GB)"),
    GPU("a100-80g", 80 * GIB, 2039, 312, 624, "NVIDIA A100 datasheet (SXM4 80GB)"),
    GPU("h100-80g", 80 * GIB, 3350, 989.4, 1978.9, "NVIDIA H100 datasheet (SXM5)"),
    GPU("h200", 143771 * 2**20, 4800, 989.4, 1978.9, "NVIDIA H200 datasheet (SXM)"),
)

GPUS: dict[str, GPU] = {g.name: g for g in _GPUS}
_ALIASES = {"a100": "a100-80g", "h100": "h100-80g", "3090": "rtx-3090", "4090": "rtx-4090"}


def gpu_names() -> str:
    return ", ".join(GPUS)


def get_gpu(name: str) -> GPU:
    """A catalog GPU by name (case-insensitive; "_" and " " read as "-"), or a one-line InputError."""
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    key = _ALIASES.get(key, key)
    if key not in GPUS:
        raise InputError(f"unknown GPU {name!r}; known GPUs: {gpu_names()}")
    return GPUS[key]
