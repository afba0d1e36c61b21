"""Fixed-length token samples: random windows of the concatenated token stream, the same for the same seed.

This is GPTQ's recipe (documents joined, tokenized once, `nsamples` windows of `seqlen` tokens at
uniformly random starts). The imatrix collector can reuse `token_stream` and `random_windows`.
`load_calibration` turns a `CalibConfig` into the samples for a model: from text, or written by
the model itself (`source="self"`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from llmopt.calibration.self_text import generate_samples, tokens_sha256
from llmopt.calibration.text import SELF, CalibText, read_texts
from llmopt.errors import OptionError
from llmopt.model.source import ModelSource

SEPARATOR = "\n\n"
# Tokenize at most this many characters per requested token (text beyond is never sampled anyway).
CHARS_PER_TOKEN_CAP = 64


@dataclass(frozen=True)
class CalibConfig:
    source: str = SELF  # a file, a preset name, or "self"
    field: str | None = None  # text field of .jsonl / .parquet records
    nsamples: int = 128
    seqlen: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        if self.source == SELF and self.field is not None:
            raise OptionError("<calib_field> applies to .jsonl and .parquet files")


def token_stream(text: CalibText, encode: Callable[[str], list[int]], max_tokens: int | None = None) -> torch.Tensor:
    """Documents joined by blank lines and tokenized once, [n] int64 (capped near `max_tokens`)."""
    cap = None if max_tokens is None else max_tokens * CHARS_PER_TOKEN_CAP
    pieces, used = [], 0
    for doc in text.documents:
        if cap is not None and used >= cap:
            break
        if cap is not None and used + len(doc) > cap:
            doc = doc[: cap - used]
        pieces.append(doc)
        used += len(doc) + len(SEPARATOR)
    ids = encode(SEPARATOR.join(pieces))
    return torch.tensor(ids, dtype=torch.int64)


def random_windows(stream: torch.Tensor, nsamples: int, seqlen: int, seed: int) -> torch.Tensor:
    """`nsamples` windows of `seqlen` tokens at random starts (seeded), [nsamples, seqlen] int64."""
    if nsamples < 1 or seqlen < 1:
        raise OptionError(f"<nsamples> and <seqlen> must be positive (got {nsamples}, {seqlen})")
    if stream.numel() < seqlen:
        raise OptionError(f"the calibration text has {stream.numel()} tokens; <seqlen> {seqlen} needs at least that many")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, stream.numel() - seqlen + 1, (nsamples,), generator=gen)
    return torch.stack([stream[s: s + seqlen] for s in starts.tolist()])


def calibration_tokens(text: CalibText, encode: Callable[[str], list[int]], cfg: CalibConfig) -> torch.Tensor:
    """The token samples for a calibration config: [nsamples, seqlen] int64."""
    stream = token_stream(text, encode, max_tokens=max(8 * cfg.nsamples * cfg.seqlen, 1 << 16))
    return random_windows(stream, cfg.nsamples, cfg.seqlen, cfg.seed)


def load_calibration(source: ModelSource, cfg: CalibConfig, device: torch.device | str = "cpu",
                     dtype: torch.dtype = torch.float32,
                     on_step: Callable[[int, int], None] | None = None) -> tuple[torch.Tensor, dict]:  # fmt: skip
    """Token samples [nsamples, seqlen] for `source`, and what to record about them (provenance).
    Self-written samples are generated in `dtype`; `on_step(done, total)` follows the generation."""
    info: dict = {"source": cfg.source, "nsamples": cfg.nsamples, "seqlen": cfg.seqlen, "seed": cfg.seed}
    if cfg.nsamples < 1 or cfg.seqlen < 2:
        raise OptionError(f"<nsamples> {cfg.nsamples} <seqlen> {cfg.seqlen}: need at least 1 sample of 2 tokens")
    if cfg.source == SELF:
        tokens = generate_samples(source, cfg.nsamples, cfg.seqlen, cfg.seed, device, on_step=on_step, dtype=dtype)
        info["sha256"] = tokens_sha256(tokens)
        return tokens, info
    text = read_texts(cfg.source, cfg.field)
    tok = source.tokenizer()
    if tok is None:
        raise OptionError(f"{source.path}: the model carries no tokenizer to read calibration text with; use <calib> self")
    tokens = calibration_tokens(text, tok.encode, cfg)
    info["sha256"] = text.sha256
    return tokens, info
