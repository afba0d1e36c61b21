"""What one timed run of an in-process engine records, and the peak-memory counter it reads.

An engine prefills B prompts of the same length together and decodes them in lockstep: every
step gives each sequence one token, so a step's time is each sequence's time per output token.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from llmopt.model.arch import ArchSpec


@dataclass
class Trace:
    tokens: list[list[int]]  # the generated ids, one list per sequence
    ttft_s: float  # prompts in -> every sequence's first new token out (prefill + one token)
    step_s: list[float]  # each decode step after the first token (one token per sequence)
    peak_memory_bytes: int | None  # device memory on an accelerator, else the process's peak RSS


class Engine(Protocol):
    """An in-process engine `bench` can time (llmopt's runtime, llama.cpp)."""

    name: str
    arch: ArchSpec
    vocab_size: int
    context: int  # positions the engine can hold per sequence
    weight_bytes: int  # weights one decode step reads (the embedding table only if the LM head is tied to it)
    kv_bytes_per_token: int  # K and V of one token in every layer, one sequence
    device: str  # "cpu", "cuda:0", ...

    def excluded_ids(self) -> set[int]: ...

    def run(self, prompts: list[list[int]], gen: int) -> Trace: ...


def reset_peak_rss() -> None:
    """Start a new high-water mark for this process's RSS (Linux: clear_refs 5 resets VmHWM)."""
    if sys.platform.startswith("linux"):
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            pass


def peak_rss_bytes() -> int | None:
    """This process's peak RSS since the last reset (VmHWM; None off Linux)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
