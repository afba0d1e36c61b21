"""Qwen3 (dense): a Llama decoder with a per-head RMSNorm on q and k before rope, no q/k/v biases,
and a head size of its own (128 for every size, so q_proj is wider than the hidden state in the
small ones); llama.cpp's "qwen3" keeps the Q/K rows unpermuted."""

from llmopt.model.families.base import Family

QWEN3 = Family(
    name="qwen3",
    hf_architectures=("Qwen3ForCausalLM",),
    hf_model_type="qwen3",
    gguf_arch="qwen3",
    permute_qk=False,
    qk_norm=True,
    hf_config_keys=lambda arch: {"attention_bias": arch.attention_bias, "use_sliding_window": False},
)
