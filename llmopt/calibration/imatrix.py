"""Importance matrices as llama.cpp defines them: per linear input channel, the mean of x² over tokens.

`compute_imatrix` runs the model a block at a time over consecutive chunks of calibration tokens
(as llama-imatrix does) and sums x² of the input of every linear of the family's stage table, seen
with hooks on the block's own forward. `importance()` gives what the quantizer weighs with,
in_sum2 / counts per tensor. The files (llama.cpp's GGUF imatrix format and its legacy .dat) are
read and written by `llmopt.formats.imatrix`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from llmopt.calibration.capture import capture_inputs, embed
from llmopt.errors import InputError
from llmopt.model.decoder import Rotary, load_block
from llmopt.model.families.base import num_experts
from llmopt.model.source import ModelSource


@dataclass
class Imatrix:
    # GGUF tensor name -> Σx² per input channel; an expert stack (ffn_*_exps): [experts, channels], each
    # expert's own (as llama-imatrix keeps them), with its counts a tensor [experts]
    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    counts: dict[str, int | torch.Tensor] = field(default_factory=dict)  # tokens seen per tensor (per expert)
    datasets: list[str] = field(default_factory=list)
    chunk_count: int = 0
    chunk_size: int = 0
    path: Path | None = None  # the file it was read from

    def importance(self) -> dict[str, torch.Tensor]:
        """Per tensor, mean x² per input channel (float32): the quantizer's importance weights; an
        expert stack's [experts, channels], each expert's over the tokens routed to it."""
        out = {}
        for name, s in self.sums.items():
            c = self.counts[name]
            out[name] = (s / (c.clamp(min=1).unsqueeze(-1) if isinstance(c, torch.Tensor) else max(c, 1))).to(torch.float32)
        return out


# ---------------------------------------------------------------------------------------- compute
def input_power(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Σx² per input channel (float64) over the rows of a linear's input `x` [..., channels], and the
    rows: the importance statistic, summed by the imatrix collector and by the automatic mix's pass."""
    flat = x.reshape(-1, x.shape[-1]).to(torch.float64)
    return (flat * flat).sum(dim=0), flat.shape[0]


def chunk_tokens(stream: torch.Tensor, chunk_size: int, max_chunks: int | None, bos_id: int | None) -> torch.Tensor:
    """Consecutive chunks of `chunk_size` tokens [n, chunk_size]; with a BOS id, each chunk starts
    with it in place of its first token (llama-imatrix's recipe)."""
    n = stream.numel() // chunk_size
    if max_chunks is not None:
        n = min(n, max_chunks)
    if n < 1:
        raise InputError(f"the calibration text has {stream.numel()} tokens; one chunk needs {chunk_size}")
    chunks = stream[: n * chunk_size].reshape(n, chunk_size).clone()
    if bos_id is not None:
        chunks[:, 0] = bos_id
    return chunks


def compute_imatrix(source: ModelSource, chunks: torch.Tensor, *, device: torch.device | str = "cpu",
                    dataset: str | None = None, on_layer: Callable[[int, int], None] | None = None) -> Imatrix:  # fmt: skip
    """Σx² and token counts of every block linear's input over `chunks` [n, t], one block in memory at a time."""
    arch = source.arch
    family = arch.family
    result = Imatrix(datasets=[dataset] if dataset else [], chunk_count=int(chunks.shape[0]),
                     chunk_size=int(chunks.shape[1]))  # fmt: skip
    hidden = embed(source, chunks, device=device)
    cos, sin = Rotary(arch).to(device)(0, chunks.shape[1], hidden.dtype)
    for layer in range(arch.num_layers):
        block = load_block(source, layer, device=device)
        sums: dict[str, torch.Tensor] = {}
        counts: dict[str, int | torch.Tensor] = {}

        def sink_for(name: str, expert: int | None) -> Callable[[torch.Tensor], None]:
            def sink(x: torch.Tensor) -> None:
                power, n = input_power(x)
                if expert is None:
                    sums[name] = sums.get(name, 0) + power
                    counts[name] = counts.get(name, 0) + n
                    return
                if name not in sums:  # one row per expert, each from the tokens routed to it
                    sums[name] = torch.zeros(num_experts(arch), power.shape[0], dtype=torch.float64, device=power.device)
                    counts[name] = torch.zeros(num_experts(arch), dtype=torch.int64)
                sums[name][expert] += power
                counts[name][expert] += n

            return sink

        hooks, hooked = [], set()
        for suffix in family.linears:
            hf_name = f"model.layers.{layer}.{suffix}.weight"
            key = (family.hf_to_gguf_name(hf_name), family.expert_of(hf_name))
            if key in hooked:  # the parts of one fused tensor (Phi-3's attn_qkv) read one input: count it once
                continue
            hooked.add(key)
            hooks.append(capture_inputs(block.get_submodule(suffix), sink_for(*key)))
        for h in hooks:
            h.__enter__()
        try:
            with torch.no_grad():
                hidden = torch.cat([block(hidden[i : i + 1], cos, sin) for i in range(hidden.shape[0])])
        finally:
            for h in hooks:
                h.__exit__(None, None, None)
        for name, s in sums.items():
            result.sums[name] = s.cpu()
            result.counts[name] = counts[name]
        del block
        if on_layer is not None:
            on_layer(layer + 1, arch.num_layers)
    return result
