"""Random models of any llmopt architecture as HF folders, for the memory and scale benchmarks
(gptq_memory.py, scale.py).

`write_random_model` writes config.json (`ArchSpec.to_hf_config`), one safetensors shard for the
embedding, one per decoder layer and one for the final norm and head (the tensors are those
`llmopt.plan.arch_tensors` lists for the architecture), and the shard index, generating each
tensor just before its shard is saved: the writer holds one layer (or the embedding) at a time,
never the model. Weights are seeded normal draws scaled by 1/sqrt(fan_in); norms are ones and
biases zeros.

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
import re
import string
from pathlib import Path
from typing import Any

from llmopt.model.arch import ArchSpec
from llmopt.plan.arch_tensors import BIAS, EMBEDDING, EXPERT, NORM, PlannedTensor, arch_tensors

SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>")  # the last ids, as in Llama 3
SPACE = "Ġ"  # byte-level BPE's spelling of " "
# Rows of a random tensor drawn in float32 at once (64 MiB); the tensor itself is kept in its dtype.
DRAW_ELEMENTS = 1 << 24
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _tensor(shape: tuple[int, ...], role: str, dtype: Any, gen: Any) -> Any:
    """Ones for a norm, zeros for a bias, else normal / sqrt(fan_in) drawn a slab of rows at a time."""
    import torch

    if role in (NORM, BIAS):
        return (torch.ones if role == NORM else torch.zeros)(shape, dtype=dtype)
    out = torch.empty(shape, dtype=dtype)
    rows = out.view(-1, shape[-1])
    step = max(1, DRAW_ELEMENTS // shape[-1])
    for start in range(0, rows.shape[0], step):
        n = min(step, rows.shape[0] - start)
        rows[start: start + n] = torch.randn(n, shape[-1], generator=gen).div_(shape[-1] ** 0.5)
    return out


def _stored(t: PlannedTensor) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) as an HF folder stores `t`: an expert stack as one tensor per expert."""
    if t.role == EXPERT and ".*." in t.hf_name:
        return [(t.hf_name.replace(".*.", f".{e}."), t.shape[1:]) for e in range(t.shape[0])]
    return [(t.hf_name, t.shape)]


def _shards(arch: ArchSpec) -> list[list[PlannedTensor]]:
    """The model's HF tensors grouped as the shards hold them: the embedding, each layer, the rest."""
    def shard(t: PlannedTensor) -> str:
        m = _LAYER.match(t.hf_name)
        return m.group(1) if m else t.role if t.role == EMBEDDING else "head"

    tensors = [t for t in arch_tensors(arch) if t.hf_name is not None]  # GGUF-only tensors (rope factors) left out
    return [list(group) for _, group in itertools.groupby(tensors, key=shard)]


def write_random_model(directory: Path, arch: ArchSpec, dtype: str = "bfloat16", seed: int = 0,
                       config: dict[str, Any] | None = None) -> int:
    """Write random weights of `arch` in `dtype`, config.json (with `config`'s keys added, e.g. token
    ids) and the shard index into `directory` (made if missing; a tokenizer is the caller's).
    Returns the bytes of weights written."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    shards = _shards(arch)
    weight_map: dict[str, str] = {}
    total = 0
    for k, planned in enumerate(shards, start=1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: _tensor(shape, t.role, getattr(torch, dtype), gen) for t in planned for name, shape in _stored(t)}
        save_file(tensors, str(directory / file), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, file))
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (directory / "config.json").write_text(json.dumps({**arch.to_hf_config(dtype), **(config or {})}, indent=1))
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
