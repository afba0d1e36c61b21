"""Random Llama-shaped HF folders for the memory and scale benchmarks (gptq_memory.py, scale.py).

`write_random_llama` writes config.json, one safetensors shard per decoder layer (plus one for the
embedding and one for the final norm and head) and the shard index, generating each tensor just
before its shard is saved: the writer holds one layer (or the embedding) at a time, never the model.
Weights are seeded normal draws scaled by 1/sqrt(fan_in); norms are ones.

`word_tokenizer` builds a byte-level BPE tokenizer of any vocabulary size without training, so a
random model can have a real tokenizer as wide as its embedding (Llama 3's 128256): the merge chain
"Ġ"+"a" -> "Ġa", "Ġa"+"b" -> "Ġab", ... makes every space-prefixed lowercase word in the vocabulary
one token. `word_text` writes text of such words drawn uniformly, so it tokenizes to ids spread
over the whole vocabulary.
"""

from __future__ import annotations

import itertools
import json
import random
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>")  # the last ids, as in Llama 3
SPACE = "Ġ"  # byte-level BPE's spelling of " "
# Rows of a random tensor drawn in float32 at once (64 MiB); the tensor itself is kept in its dtype.
DRAW_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class LlamaShape:
    """The numbers of a Llama config.json (HF's names in comments)."""

    hidden: int  # hidden_size
    ffn: int  # intermediate_size
    heads: int  # num_attention_heads
    kv_heads: int  # num_key_value_heads
    layers: int  # num_hidden_layers
    vocab: int  # vocab_size
    head_dim: int | None = None  # hidden // heads when None
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    max_positions: int = 2048  # max_position_embeddings
    dtype: str = "float16"  # torch_dtype, and the dtype the weights are written in
    rope_scaling: dict[str, Any] | None = None
    token_ids: dict[str, int] = field(default_factory=dict)  # bos_token_id, eos_token_id

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden // self.heads

    def config(self) -> dict[str, Any]:
        """config.json as HF's LlamaForCausalLM writes it."""
        cfg = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": self.hidden,
            "intermediate_size": self.ffn, "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads, "head_dim": self.dim, "vocab_size": self.vocab,
            "max_position_embeddings": self.max_positions, "rms_norm_eps": self.rms_eps, "rope_theta": self.rope_theta,
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
            "torch_dtype": self.dtype, **self.token_ids,
        }  # fmt: skip
        if self.rope_scaling is not None:
            cfg["rope_scaling"] = dict(self.rope_scaling)
        return cfg

    def layer_shapes(self) -> dict[str, tuple[int, ...]]:
        """One decoder layer's tensors (names after `model.layers.N.`) and their shapes."""
        q, kv = self.heads * self.dim, self.kv_heads * self.dim
        return {
            "input_layernorm.weight": (self.hidden,), "post_attention_layernorm.weight": (self.hidden,),
            "self_attn.q_proj.weight": (q, self.hidden), "self_attn.k_proj.weight": (kv, self.hidden),
            "self_attn.v_proj.weight": (kv, self.hidden), "self_attn.o_proj.weight": (self.hidden, q),
            "mlp.gate_proj.weight": (self.ffn, self.hidden), "mlp.up_proj.weight": (self.ffn, self.hidden),
            "mlp.down_proj.weight": (self.hidden, self.ffn),
        }  # fmt: skip


def _tensor(shape: tuple[int, ...], dtype: Any, gen: Any) -> Any:
    """Ones for a norm (1-D), else normal / sqrt(fan_in) drawn a slab of rows at a time."""
    import torch

    if len(shape) == 1:
        return torch.ones(shape, dtype=dtype)
    rows, cols = shape
    out = torch.empty(rows, cols, dtype=dtype)
    step = max(1, DRAW_ELEMENTS // cols)
    for start in range(0, rows, step):
        n = min(step, rows - start)
        out[start: start + n] = torch.randn(n, cols, generator=gen).div_(cols**0.5)
    return out


def write_random_llama(directory: Path, shape: LlamaShape, seed: int = 0) -> int:
    """Write `shape`'s random weights, config.json and the shard index into `directory` (made if
    missing; a tokenizer is the caller's). Returns the bytes of weights written."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, shape.dtype)
    gen = torch.Generator().manual_seed(seed)
    shards = [{"model.embed_tokens.weight": (shape.vocab, shape.hidden)}]
    shards += [{f"model.layers.{i}.{name}": s for name, s in shape.layer_shapes().items()} for i in range(shape.layers)]
    shards.append({"model.norm.weight": (shape.hidden,), "lm_head.weight": (shape.vocab, shape.hidden)})
    weight_map: dict[str, str] = {}
    total = 0
    for k, names in enumerate(shards, start=1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: _tensor(s, dtype, gen) for name, s in names.items()}
        save_file(tensors, str(directory / file), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, file))
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (directory / "config.json").write_text(json.dumps(shape.config(), indent=1))
    return total


def _words(count: int, seed: int) -> list[str]:
    """`count` distinct lowercase words closed under prefixes: every shorter length whole, the last
    length a seeded sample (so the vocabulary's merge chains are complete)."""
    words: list[str] = []
    for length in itertools.count(1):
        level = ["".join(p) for p in itertools.product(string.ascii_lowercase, repeat=length)]
        if len(words) + len(level) >= count:
            return words + sorted(random.Random(seed).sample(level, count - len(words)))
        words += level


def word_tokenizer(directory: Path, vocab_size: int, seed: int = 0) -> dict[str, int]:
    """Write tokenizer.json and tokenizer_config.json for a byte-level BPE of exactly `vocab_size`
    ids: the 256 bytes, words " a", " b", ..., " ab", ... and the special tokens last. Returns the
    config's token ids (bos_token_id, eos_token_id)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    n_words = vocab_size - len(alphabet) - len(SPECIAL_TOKENS)
    if n_words < len(string.ascii_lowercase):
        raise ValueError(f"a vocabulary of {vocab_size} leaves no room for words")
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    merges = []
    for word in _words(n_words, seed):
        vocab[SPACE + word] = len(vocab)
        merges.append((SPACE + word[:-1], word[-1]))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    bos, eos = SPECIAL_TOKENS[0], SPECIAL_TOKENS[1]
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos, "pad_token": eos,
        "add_bos_token": False, "model_max_length": 131072,
    }))  # fmt: skip
    return {"bos_token_id": tok.token_to_id(bos), "eos_token_id": tok.token_to_id(eos)}


def word_text(directory: Path, tokens: int, seed: int) -> str:
    """About `tokens` tokens of text for the tokenizer in `directory`: its words drawn uniformly
    (seeded), sixteen to a line ending in a full stop."""
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(directory / "tokenizer.json")).get_vocab(with_added_tokens=False)
    words = sorted(w for w in vocab if w.startswith(SPACE) and len(w) > 1)
    rng = random.Random(seed)
    lines = []
    for _ in range(max(1, tokens // 18)):  # 16 words, "." and "\n"
        lines.append(" ".join(w[1:] for w in rng.choices(words, k=16)) + ".\n")
    return "".join(" " + line for line in lines)
