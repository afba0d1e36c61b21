"""Tokenizers: read from an HF directory, or rebuilt from GGUF metadata the way llama.cpp tokenizes.

A GGUF file stores the vocabulary, merges (or scores) and a `tokenizer.ggml.pre` name for the
pre-tokenizer. We rebuild a `tokenizers.Tokenizer` with the same split regexes llama.cpp applies
for that name (llama.cpp's `llama-vocab.cpp` is the authority), so ids match llama.cpp's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from llmopt.errors import InputError, guarded

# Split regexes, applied in sequence like llama.cpp's `regex_exprs` for each pre-tokenizer name.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS: dict[str, list[str]] = {
    **{name: [_GPT2] for name in ("default", "gpt-2", "gpt2", "mpt", "olmo", "jais")},
    **{name: [r"\p{N}", _GPT2] for name in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b")},
    **{name: [_LLAMA3] for name in ("llama3", "llama-v3", "llama-bpe", "dbrx", "smaug-bpe", "falcon3")},
    **{name: [_QWEN2] for name in ("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez")},
}

# llama.cpp token types (gguf.TokenType): 3 = control (special), 4 = user-defined (matched whole).
_CONTROL, _USER_DEFINED = 3, 4


@dataclass
class TokenizerInfo:
    tokenizer: Tokenizer
    kind: str  # "bpe" (byte-level) or "sentencepiece"
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    add_bos: bool = False
    add_eos: bool = False
    chat_template: str | None = None
    pre: str | None = None  # GGUF pre-tokenizer name, when known
    _spec: dict[str, Any] | None = field(default=None, repr=False, compare=False)

    def spec(self) -> dict[str, Any]:
        """The tokenizer as its tokenizer.json dict, serialized once (0.1 s for a 49k vocabulary)."""
        if self._spec is None:
            self._spec = json.loads(self.tokenizer.to_str())
        return self._spec

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self.tokenizer.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        return guarded(lambda: self.tokenizer.encode(text).ids, "the tokenizer failed on this text", quiet=False)

    def special_ids(self) -> dict[str, int]:
        """`bos_token_id`, `eos_token_id`, `pad_token_id` as config.json and generation_config.json carry them."""
        ids = {f"{k}_token_id": self.token_id(getattr(self, f"{k}_token")) for k in ("bos", "eos", "pad")}
        return {k: v for k, v in ids.items() if v is not None}

    def summary(self) -> dict[str, Any]:
        specials = {k: getattr(self, f"{k}_token") for k in ("bos", "eos", "pad", "unk")}
        return {
            "kind": self.kind,
            "pre_tokenizer": self.pre,
            "vocab_size": self.vocab_size,
            "special_tokens": {k: {"token": v, "id": self.token_id(v)} for k, v in specials.items() if v is not None},
            "add_bos": self.add_bos,
            "add_eos": self.add_eos,
            "chat_template": self.chat_template is not None,
        }

    def save_hf(self, directory: Path, model_max_length: int) -> None:
        """tokenizer.json + tokenizer_config.json + special_tokens_map.json, as transformers writes them."""
        self.tokenizer.save(str(directory / "tokenizer.json"))
        specials = {f"{k}_token": getattr(self, f"{k}_token") for k in ("bos", "eos", "pad", "unk")}
        specials = {k: v for k, v in specials.items() if v is not None}
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **specials,
            "add_bos_token": self.add_bos,
            "add_eos_token": self.add_eos,
            "clean_up_tokenization_spaces": False,
            "model_max_length": model_max_length,
        }
        if self.chat_template:
            config["chat_template"] = self.chat_template
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
        (directory / "special_tokens_map.json").write_text(json.dumps(specials, indent=2, ensure_ascii=False) + "\n")


# ------------------------------------------------------------------------------------- HF dirs
def tokenizer_from_hf_dir(directory: Path) -> TokenizerInfo | None:
    """The tokenizer of an HF directory (tokenizer.json), or None when it has none."""
    path = directory / "tokenizer.json"
    if not path.is_file():
        return None
    tok = guarded(lambda: Tokenizer.from_file(str(path)), f"{path}: cannot read tokenizer")
    cfg: dict[str, Any] = {}
    cfg_path = directory / "tokenizer_config.json"
    if cfg_path.is_file():
        try:
            cfg = json.loads(cfg_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise InputError(f"{cfg_path}: not valid JSON ({str(e).splitlines()[0]})") from None
        if not isinstance(cfg, dict):
            raise InputError(f"{cfg_path}: expected a JSON object, got {type(cfg).__name__}")

    def special(key: str) -> str | None:
        v = cfg.get(key)
        v = v.get("content") if isinstance(v, dict) else v
        if v is not None and not isinstance(v, str):
            raise InputError(f"{cfg_path}: `{key}` must be a token string, got {type(v).__name__} {v!r:.40}")
        return v

    spec = json.loads(tok.to_str())
    model = spec.get("model", {})
    kind = "sentencepiece" if model.get("byte_fallback") else model.get("type", "unknown").lower()
    return TokenizerInfo(
        tokenizer=tok,
        kind=kind,
        _spec=spec,
        bos_token=special("bos_token"),
        eos_token=special("eos_token"),
        pad_token=special("pad_token"),
        unk_token=special("unk_token"),
        add_bos=bool(cfg.get("add_bos_token", False)),
        add_eos=bool(cfg.get("add_eos_token", False)),
        chat_template=_chat_template(cfg.get("chat_template"), cfg_path),
    )


def _chat_template(value: Any, where: Path) -> str | None:
    """A template string, or transformers' list of named templates (the "default" one is taken)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                       and isinstance(t.get("template"), str) for t in value):  # fmt: skip
        named = {t["name"]: t["template"] for t in value}
        return named.get("default")
    raise InputError(f"{where}: `chat_template` must be a string or a list of {{name, template}}, got {value!r:.40}")


# ------------------------------------------------------------------------------------- GGUF
def tokenizer_from_gguf(meta: dict[str, Any]) -> TokenizerInfo | None:
    """Rebuild the tokenizer a GGUF file describes, or None when the file has no vocabulary."""
    tokens: list[str] | None = meta.get("tokenizer.ggml.tokens")
    if tokens is None:
        return None
    tokens = _listed(meta, "tokens", str)
    model = meta.get("tokenizer.ggml.model")
    types: list[int] = _listed(meta, "token_type", int, len(tokens)) if "tokenizer.ggml.token_type" in meta else [1] * len(tokens)
    pre = meta.get("tokenizer.ggml.pre")
    if model == "gpt2":
        merges = _listed(meta, "merges", str) if "tokenizer.ggml.merges" in meta else []
        if any(" " not in m for m in merges):
            raise InputError("GGUF metadata tokenizer.ggml.merges: every merge is two tokens separated by a space")
        tok = guarded(lambda: _byte_level_bpe(tokens, merges, pre), "GGUF tokenizer metadata cannot be built into a tokenizer")
        kind = "bpe"
    elif model == "llama":
        if "tokenizer.ggml.scores" not in meta:
            raise InputError("GGUF sentencepiece tokenizer has no tokenizer.ggml.scores")
        scores = _listed(meta, "scores", (int, float), len(tokens))
        add_space = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        tok = guarded(lambda: _sentencepiece_bpe(tokens, scores, types, add_space), "GGUF tokenizer metadata cannot be built into a tokenizer")
        kind = "sentencepiece"
    else:
        raise InputError(f"unsupported GGUF tokenizer model {model!r}; supported: gpt2 (byte-level BPE), llama (sentencepiece)")
    for key in ("bos", "eos", "padding", "unknown"):
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        if i is not None and (isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(tokens)):
            raise InputError(f"GGUF metadata tokenizer.ggml.{key}_token_id is {i!r:.20}; the vocabulary has {len(tokens)} tokens")

    # Control tokens are special; user-defined ones are matched whole but are ordinary text.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == _CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == _USER_DEFINED])

    def token_at(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    info = TokenizerInfo(
        tokenizer=tok,
        kind=kind,
        bos_token=token_at("bos"),
        eos_token=token_at("eos"),
        pad_token=token_at("padding"),
        unk_token=token_at("unknown"),
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", model == "llama")),
        add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=meta.get("tokenizer.chat_template"),
        pre=pre,
    )
    _set_post_processor(info)
    return info


def _listed(meta: dict[str, Any], key: str, kind: type | tuple[type, ...], length: int | None = None) -> list:
    """A metadata array of `kind` items (of `length` items, when given), or an InputError naming the key."""
    value = meta.get(f"tokenizer.ggml.{key}")
    if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, kind) for v in value):
        raise InputError(f"GGUF metadata tokenizer.ggml.{key}: expected an array of "
                         f"{kind.__name__ if isinstance(kind, type) else 'numbers'}")  # fmt: skip
    if length is not None and len(value) != length:
        raise InputError(f"GGUF metadata tokenizer.ggml.{key} has {len(value)} items for {length} tokens")
    return value


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str | None) -> Tokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    splits = PRE_TOKENIZER_SPLITS.get(pre or "default", PRE_TOKENIZER_SPLITS["default"])
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(tokens: list[str], scores: list[float], types: list[int], add_space_prefix: bool) -> Tokenizer:
    """SentencePiece BPE as a `tokenizers` BPE: merges ranked by the score of the merged piece."""
    vocab = {t: i for i, t in enumerate(tokens)}
    candidates = []
    for piece, score in zip(tokens, scores):
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab:
                candidates.append((-score, vocab[left], vocab[right], left, right))
    candidates.sort()
    merges = [(left, right) for *_, left, right in candidates]
    unk = next((t for t, ty in zip(tokens, types) if ty == 2), None)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    norms = [normalizers.Prepend("▁")] if add_space_prefix else []
    tok.normalizer = normalizers.Sequence(norms + [normalizers.Replace(" ", "▁")])
    decs = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        decs.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(decs)
    return tok


def _set_post_processor(info: TokenizerInfo) -> None:
    """Add BOS/EOS around an encoding exactly when the file says llama.cpp adds them."""
    single, pair, specials = "$A", "$A $B", []
    for token, on, prefix in ((info.bos_token, info.add_bos, True), (info.eos_token, info.add_eos, False)):
        if on and token is not None:
            single = f"{token} {single}" if prefix else f"{single} {token}"
            pair = f"{token} {pair}" if prefix else f"{pair} {token}"
            specials.append((token, info.tokenizer.token_to_id(token)))
    if specials:
        info.tokenizer.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=list(dict.fromkeys(specials)))
    elif info.kind == "bpe":
        info.tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
