"""Llama 2/3, SmolLM, TinyLlama: the reference Llama decoder (llama3 rope scaling optional)."""

from llmopt.model.families.base import Family

LLAMA = Family(
    name="llama",
    hf_architectures=("LlamaForCausalLM",),
    hf_model_type="llama",
    gguf_arch="llama",
    permute_qk=True,
    hf_config_keys=lambda arch: {"attention_bias": arch.attention_bias, "mlp_bias": False},
)
