"""`load` and `generate`: what llmopt wrote (or any model it reads), run by the built-in runtime."""

from __future__ import annotations

import logging

from collections.abc import Callable, Sequence
from pathlib import Path

from llmopt.errors import OptionError
from llmopt.runtime.chat import apply_chat_template
from llmopt.runtime.generate import GenerationResult, Generator
from llmopt.runtime.sampling import SamplingConfig
from llmopt.runtime.speculative import DraftModel, PromptLookup
from llmopt.runtime.weights import LoadedModel, load_model


def load(model: str | Path, *, dtype: str = "auto", device: str = "auto", packed: bool = True) -> LoadedModel:
    """The runtime model of `model`: an HF directory (float or GPTQ), a GGUF file or a hub id.
    `dtype` auto is float32 on CPU and bfloat16 on CUDA; `packed` keeps GPTQ 4-bit layers packed on
    CPU (int4 kernel) instead of dequantizing them."""
    return load_model(str(model), dtype, device, packed)


def generate(model: str | Path | LoadedModel, prompt: str, *, max_tokens: int = 256, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, repetition_penalty: float = 1.0,
             seed: int | None = None, stop: Sequence[str] = (), ignore_eos: bool = False, chat: bool = False,
             system: str | None = None, draft: str | Path | None = None, num_draft: int = 4, prompt_lookup: int = 0,
             prefill_chunk: int = 512, compile: bool = False, dtype: str = "auto", device: str = "auto",
             packed: bool = True, on_text: Callable[[str], None] | None = None) -> GenerationResult:  # fmt: skip
    """Continue `prompt` (wrapped in the model's chat template with `chat`). Temperature 0 is greedy;
    `draft` (a smaller model sharing the tokenizer) or `prompt_lookup` (n-gram length) turn on
    speculative decoding, whose output is exactly the plain decoder's. `on_text` streams the text."""
    sampling = check_options(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                             repetition_penalty=repetition_penalty, chat=chat, system=system, draft=draft,
                             num_draft=num_draft, prompt_lookup=prompt_lookup, prefill_chunk=prefill_chunk,
                             max_tokens=max_tokens, seed=seed)  # fmt: skip
    target = model if isinstance(model, LoadedModel) else load(model, dtype=dtype, device=device, packed=packed)
    tok = target.tokenizer
    if tok is None:
        raise OptionError(f"{target.path}: has no tokenizer, so it cannot take a text prompt")
    if chat:
        ids = tok.tokenizer.encode(apply_chat_template(tok, prompt, system), add_special_tokens=False).ids
    else:
        ids = tok.encode(prompt)
    max_tokens = _fit_context(len(ids), max_tokens, target.model.arch.max_position_embeddings)
    drafter = None
    if draft:
        d = load(draft, dtype=dtype, device=device, packed=packed)
        if d.model.arch.vocab_size != target.model.arch.vocab_size or (d.tokenizer and d.tokenizer.encode(prompt) != tok.encode(prompt)):
            raise OptionError(f"<draft> {draft}: its tokenizer differs from the model's; a draft must share the vocabulary")
        drafter = DraftModel(d.model, len(ids) + max_tokens + num_draft + 1, d.dtype, d.device)
    elif prompt_lookup:
        drafter = PromptLookup(prompt_lookup)
    gen = Generator(target.model, tok, drafter, num_draft, prefill_chunk, compile=compile)
    return gen.generate(ids, max_tokens, sampling, list(stop), seed, ignore_eos, on_text)


def check_options(*, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                  repetition_penalty: float = 1.0, chat: bool = False, system: str | None = None,
                  draft: str | Path | None = None, num_draft: int = 4, prompt_lookup: int = 0, prefill_chunk: int = 512,
                  max_tokens: int = 256, seed: int | None = None) -> SamplingConfig:  # fmt: skip
    """Refuse option combinations `generate` cannot run, before any model is loaded; the sampling config."""
    if seed is not None and not 0 <= seed < 2**64:
        raise OptionError(f"<seed> {seed}: expected 0 to 2**64 - 1 (torch's generator seed)")
    if draft and prompt_lookup:
        raise OptionError("choose one of <draft> and <prompt_lookup>")
    if prompt_lookup < 0 or num_draft < 1 or prefill_chunk < 1:
        raise OptionError("<prompt_lookup> must be >= 0, <num_draft> and <prefill_chunk> >= 1")
    if max_tokens < 1:
        raise OptionError(f"<max_tokens> must be at least 1, got {max_tokens}")
    if system and not chat:
        raise OptionError("<system> needs <chat>")
    sampling = SamplingConfig(temperature, top_k, top_p, min_p, repetition_penalty)
    sampling.check()
    return sampling


def _fit_context(prompt_tokens: int, max_tokens: int, context: int) -> int:
    """`max_tokens`, cut to what the model's context leaves after the prompt (as llama.cpp stops at
    n_ctx), with a warning; a prompt that fills the context is an error."""
    if prompt_tokens >= context:
        raise OptionError(f"the prompt has {prompt_tokens} tokens; the model's context is {context}")
    room = context - prompt_tokens
    if max_tokens > room:
        logging.getLogger(__name__).warning("max_tokens %d is more than the context leaves after the prompt; "
                                            "generating at most %d tokens", max_tokens, room)
        return room
    return max_tokens
