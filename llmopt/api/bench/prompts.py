"""Synthetic prompts: seeded token ids of an exact length, the same for every engine.

Prompt i of length n depends only on (seed, n, i) and the vocabulary, so batch 4 runs prompts 0-3
of the same texts that batch 1 ran prompt 0 of, and llmopt, llama.cpp and a server read identical
ids. Special tokens (BOS, EOS, padding, unknown) are never drawn: an EOS in a prompt, or a BOS
mid-prompt, would make engines treat the text differently.
"""

from __future__ import annotations

import random
from collections.abc import Iterable


def synthetic_prompts(count: int, length: int, vocab_size: int, seed: int = 0,
                      exclude: Iterable[int] = ()) -> list[list[int]]:
    """`count` prompts of `length` ids each, drawn uniformly from [0, vocab_size) minus `exclude`."""
    excluded = {i for i in exclude if 0 <= i < vocab_size}
    if vocab_size - len(excluded) < 1:
        raise ValueError("no token ids left to draw prompts from")
    prompts = []
    for i in range(count):
        rng = random.Random(f"llmopt-bench:{seed}:{length}:{i}")  # str seeds hash the same in every process
        ids: list[int] = []
        while len(ids) < length:
            t = rng.randrange(vocab_size)
            if t not in excluded:
                ids.append(t)
        prompts.append(ids)
    return prompts


def special_token_ids(tokenizer) -> set[int]:  # noqa: ANN001 (a TokenizerInfo; imported lazily by callers)
    """The ids a synthetic prompt must not contain: BOS, EOS, padding and unknown."""
    if tokenizer is None:
        return set()
    unk = tokenizer.token_id(tokenizer.unk_token)
    return set(tokenizer.special_ids().values()) | ({unk} if unk is not None else set())


def prompt_text(tokenizer, ids: list[int], tries: int = 32) -> str:  # noqa: ANN001 (a TokenizerInfo)
    """Text that the model's tokenizer reads back as exactly len(ids) tokens (BOS aside), for servers
    that take only text (llama-cpp-python's). Random ids need not survive decode -> encode: a byte
    token alone is partial UTF-8, added tokens are matched whole, neighbours merge. So only ids
    whose own text is whole are kept, the text's own tokens replace them, and the list is cut or
    refilled (seeded by the prompt) until the text reads back at the length."""
    tok = tokenizer.tokenizer
    want = len(ids)
    added = set(tok.get_added_tokens_decoder())
    rng = random.Random(f"llmopt-bench-text:{ids[:8]}:{want}")

    def whole(i: int) -> bool:
        piece = tok.decode([i], skip_special_tokens=False)
        return i not in added and piece != "" and "\ufffd" not in piece

    current = [i for i in ids if whole(i)]
    text = ""
    for _ in range(tries):
        while len(current) < want:
            i = rng.randrange(tokenizer.vocab_size)
            if whole(i):
                current.append(i)
        text = tok.decode(current[:want], skip_special_tokens=False)
        again = tok.encode(text, add_special_tokens=False).ids
        if len(again) == want:
            return text
        current = again[:want]
    return text
