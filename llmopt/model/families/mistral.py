"""Mistral: a Llama decoder with optional sliding-window attention; llama.cpp stores it as "llama"."""

from llmopt.model.families.base import Family

MISTRAL = Family(
    name="mistral",
    hf_architectures=("MistralForCausalLM",),
    hf_model_type="mistral",
    gguf_arch="llama",
    permute_qk=True,
    reads_gguf=False,
    hf_config_keys=lambda arch: {"attention_bias": arch.attention_bias, "mlp_bias": False,
                                 "sliding_window": arch.sliding_window},
)
