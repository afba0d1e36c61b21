"""An HF tokenizer as GGUF metadata: the `tokenizer.ggml.*` keys llama.cpp tokenizes with.

Byte-level BPE (GPT-2 style: SmolLM, Llama 3, Qwen2) is written as model "gpt2" with its tokens,
merges and a `tokenizer.ggml.pre` name that tells llama.cpp which split regexes to apply; we find
that name by comparing the tokenizer's own pre-tokenizer regexes with llama.cpp's table
(`llmopt.model.tokenizer.PRE_TOKENIZER_SPLITS`). SentencePiece-style BPE (byte fallback: Llama 2,
Mistral) is written as model "llama" with per-token scores that rank its merges.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gguf import TokenType

from llmopt.errors import InputError
from llmopt.model.tokenizer import PRE_TOKENIZER_SPLITS, TokenizerInfo

# The names convert_hf_to_gguf.py writes, preferred when several llama.cpp names share the regexes.
_PREFERRED_PRE = ("smollm", "llama-bpe", "qwen2", "gpt-2")
_GPT2_REGEX = PRE_TOKENIZER_SPLITS["gpt2"][0]


@dataclass
class VocabMetadata:
    model: str  # "gpt2" | "llama"
    tokens: list[str]
    token_types: list[int]
    merges: list[str] | None = None
    scores: list[float] | None = None
    pre: str | None = None
    add_space_prefix: bool = False


def _split_regexes(pre_tokenizer: dict[str, Any] | None) -> list[str] | None:
    """The regexes a `tokenizers` pre-tokenizer splits with, in order; None if it is not regex-only."""
    if pre_tokenizer is None:
        return []
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        out: list[str] = []
        for part in pre_tokenizer.get("pretokenizers", []):
            regexes = _split_regexes(part)
            if regexes is None:
                return None
            out += regexes
        return out
    if kind == "Split":
        pattern = pre_tokenizer.get("pattern", {})
        return [pattern.get("Regex") or pattern.get("String")]
    if kind == "Digits":
        return [r"\p{N}"] if pre_tokenizer.get("individual_digits") else [r"\p{N}+"]
    if kind == "ByteLevel":
        return [_GPT2_REGEX] if pre_tokenizer.get("use_regex", True) else []
    return None


def pre_tokenizer_name(pre_tokenizer: dict[str, Any] | None) -> str:
    """llama.cpp's `tokenizer.ggml.pre` for a byte-level BPE pre-tokenizer (tokenizer.json's)."""
    regexes = _split_regexes(pre_tokenizer)
    if regexes is not None:
        matches = [name for name, splits in PRE_TOKENIZER_SPLITS.items() if splits == regexes]
        for name in _PREFERRED_PRE:
            if name in matches:
                return name
        if matches:
            return matches[0]
    raise InputError(
        "the tokenizer's pre-tokenizer matches none llama.cpp knows (tokenizer.ggml.pre); "
        f"split regexes: {regexes!r}"
    )


def vocab_metadata(info: TokenizerInfo, vocab_size: int) -> VocabMetadata:
    """Tokens, types and merges (or scores) for a model whose embedding has `vocab_size` rows."""
    tok = info.tokenizer
    spec = info.spec()
    model = spec.get("model", {})
    if model.get("type") != "BPE":
        raise InputError(f"cannot write a {model.get('type')} tokenizer to GGUF; supported: BPE and SentencePiece-BPE")
    vocab = tok.get_vocab(with_added_tokens=True)
    n = max(vocab_size, max(vocab.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = [int(TokenType.UNUSED)] * n
    for text, i in vocab.items():
        tokens[i] = text
        types[i] = int(TokenType.NORMAL)
    for i, added in tok.get_added_tokens_decoder().items():
        types[i] = int(TokenType.CONTROL if added.special else TokenType.USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    if info.kind != "sentencepiece":
        return VocabMetadata("gpt2", tokens, types, merges=merges, pre=pre_tokenizer_name(spec.get("pre_tokenizer")))
    # SentencePiece BPE: llama.cpp merges the adjacent pair whose merged piece scores highest, so the
    # score of a piece is minus the rank of the merge that makes it.
    scores = [-float(len(merges) + i) for i in range(n)]
    for rank, merge in enumerate(merges):
        piece = merge.replace(" ", "", 1)
        if piece in vocab and scores[vocab[piece]] < -float(rank):
            scores[vocab[piece]] = -float(rank)
    for text, i in vocab.items():
        if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            types[i] = int(TokenType.BYTE)
    unk = model.get("unk_token")
    if unk in vocab:
        types[vocab[unk]] = int(TokenType.UNKNOWN)
    normalizer = json.dumps(spec.get("normalizer"))
    add_space_prefix = '"Prepend"' in normalizer or '"prepend_scheme": "always"' in json.dumps(spec.get("pre_tokenizer"))
    return VocabMetadata("llama", tokens, types, scores=scores, add_space_prefix=add_space_prefix)
