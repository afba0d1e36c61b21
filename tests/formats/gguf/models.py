"""Random HF models whose rows divide into 256, so every K-quant applies (SmolLM2's 576 does not)."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.factories import make_tokenizer


def make_wide_hf(directory: Path, family: str = "llama", *, hidden: int = 256, ffn: int = 512, layers: int = 4,
                 heads: int = 4, kv_heads: int = 2, tie: bool = False, seed: int = 0) -> Path:
    """An HF directory with a random `family` model (qwen2 has q/k/v biases) and a small BPE tokenizer."""
    import transformers

    directory.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(directory)
    vocab = (tok.get_vocab_size() + 255) // 256 * 256  # embedding rows padded, as real models do
    common = dict(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, vocab_size=vocab, max_position_embeddings=512, tie_word_embeddings=tie,
                  rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, rope_theta=10000.0)
    config, cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[family]
    torch.manual_seed(seed)
    model = cls(config(**common)).to(torch.float16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + torch.randn_like(p) * 0.1)
            elif name.endswith(".bias"):
                p.copy_(torch.randn_like(p) * 0.1)
            else:  # heavier tails than the init, as trained weights have
                p.copy_(torch.randn_like(p) * 0.02 * (1 + torch.rand_like(p) ** 8 * 4))
    model.save_pretrained(directory)
    return directory
