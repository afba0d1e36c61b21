"""Qwen2 / Qwen2.5: a Llama decoder with biases on q/k/v; llama.cpp keeps its Q/K rows unpermuted."""

from llmopt.model.families.base import Family

QWEN2 = Family(
    name="qwen2",
    hf_architectures=("Qwen2ForCausalLM",),
    hf_model_type="qwen2",
    gguf_arch="qwen2",
    permute_qk=False,
    qkv_bias=True,
    hf_config_keys=lambda arch: {"use_sliding_window": False},
)
