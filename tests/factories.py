"""Tiny random models made inside the tests: HF directories for each family and GGUF files of them.

The GGUF files are written here with the `gguf` package's writer the way llama.cpp's
convert_hf_to_gguf.py lays them out (names, metadata, Q/K permutation for "llama"), independently
of llmopt's own code, so reading them tests llmopt against an outside layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

CORPUS = (
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
    "How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow. 0123456789 "
    "In the beginning the universe was created. This has made a lot of people very angry. "
) * 20

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def make_tokenizer(directory: Path, vocab_size: int = 320) -> "object":
    """Train a small byte-level BPE (like GPT-2's) and save it as an HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([CORPUS], trainer)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
        "unk_token": "<|endoftext|>", "pad_token": "<|im_end|>", "add_bos_token": False,
    }))
    return tok


def make_tiny_hf(directory: Path, family: str = "llama", tie: bool = False, seed: int = 0,
                 dtype: torch.dtype = torch.float32, layers: int = 2, kv_heads: int = 2) -> Path:
    """A random tiny model of `family` saved as an HF directory (safetensors) with a tokenizer."""
    import transformers

    directory.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(directory)
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=kv_heads, vocab_size=tok.get_vocab_size(), max_position_embeddings=256,
                  tie_word_embeddings=tie, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    if family == "llama":
        config = transformers.LlamaConfig(**common, rope_theta=10000.0)
        cls = transformers.LlamaForCausalLM
    elif family == "mistral":
        config = transformers.MistralConfig(**common, rope_theta=10000.0, sliding_window=None)
        cls = transformers.MistralForCausalLM
    elif family == "qwen2":
        config = transformers.Qwen2Config(**common, rope_theta=10000.0)
        cls = transformers.Qwen2ForCausalLM
    elif family == "qwen3":  # Qwen3-0.6B's shape scaled down: head_dim apart from hidden/heads, GQA 2
        config = transformers.Qwen3Config(**{**common, "hidden_size": 128, "intermediate_size": 384, "rms_norm_eps": 1e-6},
                                          head_dim=64, rope_theta=1000000.0)
        cls = transformers.Qwen3ForCausalLM
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    model = cls(config).to(dtype)
    perturb_norms(model)
    model.save_pretrained(directory)
    return directory


def perturb_norms(model: torch.nn.Module) -> None:
    """Random init leaves norms at their neutral value and biases at 0: add noise so they matter."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_reference_gguf(hf_dir: Path, out: Path, tensor_type: str = "F32") -> Path:
    """A GGUF of an HF directory, laid out as llama.cpp's converter does (F32/F16/Q8_0 tensors); Phi-3
    as its Phi3MiniModel: attn_qkv and ffn_up straight from the fused tensors, longrope's factors as
    F32 tensors with rope.scaling.attn_factor; Gemma 3 as its Gemma3Model: norms stored as 1 + w, the
    post-attention / pre- and post-FFN norms under their own names, the sliding window."""
    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = {"qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3", "gemma3_text": "gemma3"}.get(cfg["model_type"], "llama")
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name("tiny")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    rope = cfg.get("rope_parameters") or {}
    w.add_rope_freq_base(cfg.get("rope_theta") or rope.get("full_attention", rope)["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(head_dim)
    if head_dim * cfg["num_attention_heads"] != cfg["hidden_size"]:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(0 if tensor_type == "F32" else 1)
    if arch == "phi3":
        _phi3_keys(w, cfg)
    if arch == "gemma3":
        w.add_sliding_window(cfg["sliding_window"])

    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    added = {a["content"]: a["id"] for a in tok["added_tokens"]}
    tokens = [None] * (max(list(vocab.values()) + list(added.values())) + 1)
    for t, i in {**vocab, **added}.items():
        tokens[i] = t
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in added else 1 for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)

    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    block = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
             "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
             "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
             "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
             "self_attn.v_proj.bias": "attn_v.bias", "mlp.gate_proj.weight": "ffn_gate.weight",
             "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
             "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
             "self_attn.qkv_proj.weight": "attn_qkv.weight", "mlp.gate_up_proj.weight": "ffn_up.weight"}
    if arch == "gemma3":  # gguf's MODEL_TENSORS[GEMMA3]
        block.update({"post_attention_layernorm.weight": "post_attention_norm.weight",
                      "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                      "post_feedforward_layernorm.weight": "post_ffw_norm.weight"})
    tensors = load_file(str(hf_dir / "model.safetensors"))
    for name, value in tensors.items():
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            gname = f"blk.{i}.{block[rest]}"
        else:
            gname = names[name]
        value = value.astype(np.float32)
        if arch == "gemma3" and name.endswith("norm.weight"):  # Gemma3Model's norm_shift
            value = value + np.float32(1.0)
        if arch == "llama" and rest_is(name, "q_proj"):
            value = _permute(value, cfg["num_attention_heads"])
        if arch == "llama" and rest_is(name, "k_proj"):
            value = _permute(value, cfg["num_key_value_heads"])
        if value.ndim == 1 or tensor_type == "F32":
            w.add_tensor(gname, value)
        elif tensor_type == "F16":
            w.add_tensor(gname, value.astype(np.float16))
        else:
            qtype = getattr(gguf.GGMLQuantizationType, tensor_type)
            w.add_tensor(gname, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _phi3_keys(w, cfg: dict) -> None:  # noqa: ANN001 - a gguf.GGUFWriter
    """What convert_hf_to_gguf.py's Phi3MiniModel adds: the pre-extension context, the sliding window,
    and for longrope the attention factor and the factor tensors."""
    import math

    original = cfg["original_max_position_embeddings"]
    w.add_rope_scaling_orig_ctx_len(original)
    w.add_sliding_window(cfg.get("sliding_window") or 0)
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if "long_factor" in rope:
        scale = cfg["max_position_embeddings"] / original
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))


def rest_is(name: str, proj: str) -> bool:
    return f".self_attn.{proj}." in name


def write_checkpoint(source, spec, blocks, out: Path, fmt: str = "gptq", on_block=None) -> Path:
    """Hand every block the pipeline yields to the checkpoint writer, as `llmopt.api.quantize` does."""
    from llmopt.formats.checkpoint import CheckpointWriter

    with CheckpointWriter(source, spec, out, fmt) as writer:
        for block in blocks:
            writer.add(block)
            if on_block is not None:
                on_block(block)
        return writer.finish()
