"""Runtime memory beyond weights and KV cache, itemized so users can see what they pay for.

Three parts, each an estimate of what an engine such as llama.cpp or vLLM allocates:
- activations / workspace for one prefill chunk (llama.cpp's n_ubatch = 512 tokens): float32
  hidden states, q/k/v, the SwiGLU intermediates, and the attention score matrix of the chunk
  against the whole context (chunk x heads x context; kernels without flash attention hold it);
- the logits buffer: one float32 row of the vocabulary per sequence in the batch;
- a per-device constant: the CUDA context, cuBLAS workspace and allocator slack (~0.5 GiB on
  recent drivers); zero when planning for CPU memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmopt.model.arch import ArchSpec

PREFILL_CHUNK = 512  # tokens per prefill step (llama.cpp's default n_ubatch)
F32 = 4
DEVICE_CONTEXT_BYTES = 512 * 2**20


@dataclass(frozen=True)
class Overhead:
    activations: int
    logits: int
    device_context: int

    @property
    def total(self) -> int:
        return self.activations + self.logits + self.device_context


def activation_bytes(arch: ArchSpec, context: int, chunk: int = PREFILL_CHUNK, tp: int = 1) -> int:
    """Peak per-device workspace of one prefill chunk (heads and the MLP split across `tp` devices)."""
    chunk = min(chunk, context)
    q = arch.num_heads * arch.head_dim
    kv = arch.num_kv_heads * arch.head_dim
    per_token = 2 * arch.hidden_size + (q + 2 * kv + 2 * arch.intermediate_size) / tp
    scores = arch.num_heads / tp * context
    return int(chunk * F32 * (per_token + scores))


def logits_bytes(arch: ArchSpec, batch: int = 1) -> int:
    return F32 * arch.vocab_size * batch


def runtime_overhead(arch: ArchSpec, context: int, batch: int = 1, on_gpu: bool = True, tp: int = 1) -> Overhead:
    """Per-device overhead for serving `batch` sequences of `context` tokens."""
    return Overhead(
        activations=activation_bytes(arch, context, tp=tp),
        logits=logits_bytes(arch, batch),
        device_context=DEVICE_CONTEXT_BYTES if on_gpu else 0,
    )
