"""Speed upper bounds (rooflines), not predictions: no engine beats them, good ones reach 60-80%.

Decode is memory-bound: each step streams every weight it uses once (shared by the whole batch)
plus each sequence's KV cache, so tokens/s per sequence <= bandwidth / bytes read per step. For
MoE models a step reads only the experts its tokens are routed to. Prefill is compute-bound:
~2 FLOPs per active parameter per token plus the attention scores (QK^T and AV over the causal
half of the context), divided by the device's dense peak. llama.cpp multiplies quantized GGUF
weights with int8 tensor cores (activations quantized to q8_1), so those use the int8 peak;
float and GPTQ/AWQ (fp16 Marlin-style kernels) use the bf16 peak.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmopt.model.arch import ArchSpec
from llmopt.plan.arch_tensors import experts_per_token, num_experts


@dataclass(frozen=True)
class Device:
    """What the rooflines need: aggregate bandwidth and peaks across the devices used."""

    bandwidth_gbs: float
    bf16_tflops: float | None = None
    int8_tops: float | None = None


def experts_touched_fraction(arch: ArchSpec, batch: int) -> float:
    """Expected share of experts a decode step reads when `batch` tokens route independently."""
    e, k = num_experts(arch), experts_per_token(arch)
    if not e:
        return 1.0
    return 1.0 - (1.0 - k / e) ** batch


def decode_bytes_per_step(arch: ArchSpec, weight_bytes: int, expert_bytes: int, kv_bytes_per_seq: int,
                          batch: int = 1) -> int:
    """Bytes read from memory for one decode step of `batch` sequences at the given context."""
    weights = weight_bytes - expert_bytes + expert_bytes * experts_touched_fraction(arch, batch)
    return int(weights + batch * kv_bytes_per_seq)


def decode_tokens_per_s(bytes_per_step: int, device: Device) -> float:
    """Upper bound on tokens/s for each sequence (the batch produces batch x this)."""
    return device.bandwidth_gbs * 1e9 / bytes_per_step


def prefill_flops(arch: ArchSpec, active_params: int, tokens: int, batch: int = 1) -> float:
    """FLOPs to prefill `batch` prompts of `tokens` each: matmuls plus causal attention."""
    matmul = 2.0 * active_params * tokens
    attention = 2 * 2.0 * arch.num_layers * arch.num_heads * arch.head_dim * tokens * tokens / 2
    return batch * (matmul + attention)


def prefill_seconds(flops: float, device: Device, int8: bool) -> float | None:
    """Lower bound on prefill time at the device's dense peak, or None when the peak is unknown."""
    peak = device.int8_tops if int8 else device.bf16_tflops
    if not peak:
        return None
    return flops / (peak * 1e12)
