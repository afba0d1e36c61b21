"""`load` and `generate`: what llmopt wrote (or any model it reads), run by the built-in runtime."""

from __future__ import annotations

import json
import logging
import time

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from llmopt.errors import InputError, OptionError
from llmopt.runtime.chat import apply_chat_template
from llmopt.runtime.generate import GenerationResult, Generator, Metrics
from llmopt.runtime.sampling import SamplingConfig
from llmopt.runtime.self_speculative import LayerSkipDraft
from llmopt.runtime.skip_search import search_skip_layers
from llmopt.runtime.speculative import DraftModel, PromptLookup
from llmopt.runtime.weights import LoadedModel, load_model


def load(model: str | Path, *, dtype: str = "auto", device: str = "auto", packed: bool = True,
         keep_quantized: bool | None = None) -> LoadedModel:
    """The runtime model of `model`: an HF directory (float or GPTQ), a GGUF file or a hub id.
    `dtype` auto is float32 on CPU and bfloat16 on CUDA; `packed` keeps GPTQ 4-bit layers packed and
    lets a GGUF's weights keep their quantized form on CPU (memory about the file's size;
    runtime/gguf_linear.py): always with `keep_quantized`, never with False, and with None when
    dequantized they would not fit (runtime.weights.keep_gguf_quantized). `packed=False` dequantizes."""
    return load_model(str(model), dtype, device, packed, gguf_quantized=keep_quantized)


def generate(model: str | Path | LoadedModel, prompt: str, *, max_tokens: int = 256, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, repetition_penalty: float = 1.0,
             seed: int | None = None, stop: Sequence[str] = (), ignore_eos: bool = False, chat: bool = False,
             system: str | None = None, draft: str | Path | None = None, num_draft: int = 4, prompt_lookup: int = 0,
             self_speculative: bool = False, skip_layers: Sequence[int] | None = None,
             prefill_chunk: int = 512, compile: bool = False, dtype: str = "auto", device: str = "auto",
             packed: bool = True, keep_quantized: bool | None = None,
             on_text: Callable[[str], None] | None = None) -> GenerationResult:  # fmt: skip
    """Continue `prompt` (wrapped in the model's chat template with `chat`). Temperature 0 is greedy;
    `draft` (a smaller model sharing the tokenizer), `prompt_lookup` (n-gram length) or
    `self_speculative` (the model itself with `skip_layers` skipped, searched on the prompt when not
    given) turn on speculative decoding, whose output is exactly the plain decoder's. `on_text`
    streams the text."""
    sampling = check_options(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                             repetition_penalty=repetition_penalty, chat=chat, system=system, draft=draft,
                             num_draft=num_draft, prompt_lookup=prompt_lookup, self_speculative=self_speculative,
                             skip_layers=skip_layers, prefill_chunk=prefill_chunk, max_tokens=max_tokens,
                             seed=seed)  # fmt: skip
    target = model if isinstance(model, LoadedModel) else load(model, dtype=dtype, device=device, packed=packed,
                                                               keep_quantized=keep_quantized)
    tok = target.tokenizer
    if tok is None:
        raise OptionError(f"{target.path}: has no tokenizer, so it cannot take a text prompt")
    ids = _encode(tok, prompt, chat, system)
    max_tokens = _fit_context(len(ids), max_tokens, target.model.arch.max_position_embeddings)
    drafter, notes = None, Metrics()
    if self_speculative or skip_layers is not None:
        drafter = _layer_skip_drafter(target.model, ids, sampling, num_draft, skip_layers, notes)
    elif draft:
        d = load(draft, dtype=dtype, device=device, packed=packed, keep_quantized=keep_quantized)
        if d.model.arch.vocab_size != target.model.arch.vocab_size or (d.tokenizer and d.tokenizer.encode(prompt) != tok.encode(prompt)):
            raise OptionError(f"<draft> {draft}: its tokenizer differs from the model's; a draft must share the vocabulary")
        drafter = DraftModel(d.model, len(ids) + max_tokens + num_draft + 1, d.dtype, d.device)
    elif prompt_lookup:
        drafter = PromptLookup(prompt_lookup)
    gen = Generator(target.model, tok, drafter, num_draft, prefill_chunk, compile=compile)
    result = gen.generate(ids, max_tokens, sampling, list(stop), seed, ignore_eos, on_text)
    result.metrics.skip_layers, result.metrics.skip_search_s = notes.skip_layers, notes.skip_search_s
    result.metrics.predicted_speedup = notes.predicted_speedup
    return result


def _layer_skip_drafter(model, ids: list[int], sampling: SamplingConfig, num_draft: int,
                        skip_layers: Sequence[int] | None, notes: Metrics) -> LayerSkipDraft | None:
    """The self-speculative drafter: `skip_layers` as given, or the search's set on the prompt. A
    searched set predicted to be slower than plain decoding is not used (the output is the same
    either way), with a warning; the search's numbers go into `notes`."""
    if skip_layers is not None:
        drafter = LayerSkipDraft(model, skip_layers)
        notes.skip_layers = list(drafter.skip)
        return drafter
    choice = search_skip_layers(model, ids, sampling, num_draft)
    notes.skip_search_s, notes.predicted_speedup = round(choice.seconds, 3), round(choice.predicted_speedup, 3)
    if not choice.pays_off:
        logging.getLogger(__name__).warning(
            "self-speculation is predicted at %.2fx plain decoding here (best skip set %s, acceptance %.2f); "
            "decoding plainly (skip_layers forces a set)", choice.predicted_speedup,
            ",".join(map(str, choice.skip)) or "none", choice.acceptance)
        notes.skip_layers = []
        return None
    notes.skip_layers = list(choice.skip)
    return LayerSkipDraft(model, choice.skip)


# What one request of a batch may set for itself (a line of `--prompts`), and the JSON types it takes.
REQUEST_KEYS: dict[str, tuple[type, ...]] = {
    "prompt": (str,), "id": (str, int, float, bool, list, dict, type(None)), "max_tokens": (int,), "temperature": (int, float),
    "top_k": (int,), "top_p": (int, float), "min_p": (int, float), "repetition_penalty": (int, float), "seed": (int,),
    "stop": (str, list), "ignore_eos": (bool,),
}


@dataclass
class BatchOutput:
    """`generate_batch`'s results (in the order of the prompts) and how the batch ran."""

    results: list[GenerationResult]
    seconds: float
    forwards: int  # packed forward passes
    preemptions: int
    kv_blocks: int
    block_size: int


def read_prompts(path: str | Path) -> tuple[list[dict], list[str]]:
    """The requests of a JSON-lines file (one object a line: "prompt" and optional per-request
    settings, see `REQUEST_KEYS`; blank lines skipped) and their labels, "FILE:LINE", for errors."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: cannot read prompts ({e.__class__.__name__}: {e})") from None
    entries, labels = [], []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        label = f"{path}:{number}"
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{label}: not a JSON object ({e.msg} at column {e.colno})") from None
        entries.append(check_request(entry, label))
        labels.append(label)
    if not entries:
        raise InputError(f"{path}: no prompts (expected one JSON object a line)")
    return entries, labels


def check_request(entry: object, label: str) -> dict:
    """`entry` if it is a request object of known keys with values of the right JSON types."""
    if not isinstance(entry, dict):
        raise InputError(f"{label}: expected a JSON object with a \"prompt\", got {type(entry).__name__}")
    if not isinstance(entry.get("prompt"), str):
        raise InputError(f"{label}: needs \"prompt\": a string")
    for key, value in entry.items():
        if key not in REQUEST_KEYS:
            raise InputError(f"{label}: unknown key {key!r} (known: {', '.join(REQUEST_KEYS)})")
        types = REQUEST_KEYS[key]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise InputError(f"{label}: {key!r} must be {' or '.join(t.__name__ for t in types)}, got {json.dumps(value)[:40]}")
    stop = entry.get("stop")
    if isinstance(stop, list) and not all(isinstance(s, str) for s in stop):
        raise InputError(f"{label}: 'stop' must be a string or a list of strings")
    return entry


def generate_batch(model: str | Path | LoadedModel, prompts: Sequence[str | Mapping], *, labels: Sequence[str] | None = None,
                   max_batch: int = 16, kv_blocks: int = 0, block_size: int = 16, max_tokens: int = 256,
                   temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                   repetition_penalty: float = 1.0, seed: int | None = None, stop: Sequence[str] = (),
                   ignore_eos: bool = False, chat: bool = False, system: str | None = None, num_draft: int = 4,
                   prompt_lookup: int = 0, prefill_chunk: int = 512, dtype: str = "auto", device: str = "auto",
                   packed: bool = True, keep_quantized: bool | None = None) -> BatchOutput:  # fmt: skip
    """Continue many prompts at once (continuous batching over a paged KV cache with prefix sharing).
    A prompt is a string or a mapping with "prompt" and any of `REQUEST_KEYS`, which override the
    keyword defaults for that request. `prefill_chunk` is the token budget of one forward;
    `kv_blocks` 0 sizes the pool for the `max_batch` longest requests at once."""
    from llmopt.runtime.batch import BatchEngine, Request, pool_blocks
    from llmopt.runtime.paged import BlockPool

    if max_batch < 1:
        raise OptionError(f"<max_batch> must be at least 1, got {max_batch}")
    if kv_blocks < 0 or block_size < 1:
        raise OptionError("<kv_blocks> must be >= 0 (0 = enough for <max_batch> requests) and <block_size> >= 1")
    defaults = dict(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                    repetition_penalty=repetition_penalty, seed=seed, stop=list(stop), ignore_eos=ignore_eos)
    check_options(**{k: v for k, v in defaults.items() if k not in ("stop", "ignore_eos")}, chat=chat, system=system,
                  num_draft=num_draft, prompt_lookup=prompt_lookup, prefill_chunk=prefill_chunk)
    labels = list(labels) if labels is not None else [f"prompt {i + 1}" for i in range(len(prompts))]
    entries = [check_request({"prompt": p} if isinstance(p, str) else dict(p), label) for p, label in zip(prompts, labels)]
    target = model if isinstance(model, LoadedModel) else load(model, dtype=dtype, device=device, packed=packed,
                                                               keep_quantized=keep_quantized)
    tok = target.tokenizer
    if tok is None:
        raise OptionError(f"{target.path}: has no tokenizer, so it cannot take a text prompt")
    context = target.model.arch.max_position_embeddings
    requests = []
    for entry, label in zip(entries, labels):
        opts = {**defaults, **{k: v for k, v in entry.items() if k in defaults}}
        try:
            sampling = check_options(**{k: v for k, v in opts.items() if k not in ("stop", "ignore_eos")})
            ids = _encode(tok, entry["prompt"], chat, system)
            opts["max_tokens"] = _fit_context(len(ids), opts["max_tokens"], context)
        except OptionError as e:
            raise InputError(f"{label}: {e.render()}") from None
        stops = [opts["stop"]] if isinstance(opts["stop"], str) else opts["stop"]
        requests.append(Request(ids, opts["max_tokens"], sampling, tuple(stops), opts["seed"], opts["ignore_eos"]))
    lookahead = num_draft + 1 if prompt_lookup else 1
    blocks = kv_blocks or pool_blocks([len(r.prompt_ids) + r.max_tokens + lookahead for r in requests], max_batch, block_size)
    pool = BlockPool(target.model.arch, blocks, block_size, target.dtype, target.device)
    engine = BatchEngine(target.model, pool, tok, max_batch=max_batch, token_budget=prefill_chunk,
                         prompt_lookup=prompt_lookup, num_draft=num_draft)
    t0 = time.perf_counter()
    results = engine.run(requests)
    return BatchOutput(results, time.perf_counter() - t0, engine.forwards, engine.preemptions, blocks, block_size)


def _encode(tok, prompt: str, chat: bool, system: str | None) -> list[int]:
    """The prompt's token ids (inside the model's chat template with `chat`)."""
    if chat:
        return tok.tokenizer.encode(apply_chat_template(tok, prompt, system), add_special_tokens=False).ids
    return tok.encode(prompt)


def check_options(*, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                  repetition_penalty: float = 1.0, chat: bool = False, system: str | None = None,
                  draft: str | Path | None = None, num_draft: int = 4, prompt_lookup: int = 0,
                  self_speculative: bool = False, skip_layers: Sequence[int] | None = None, prefill_chunk: int = 512,
                  max_tokens: int = 256, seed: int | None = None) -> SamplingConfig:  # fmt: skip
    """Refuse option combinations `generate` cannot run, before any model is loaded; the sampling config."""
    if seed is not None and not 0 <= seed < 2**64:
        raise OptionError(f"<seed> {seed}: expected 0 to 2**64 - 1 (torch's generator seed)")
    if draft and prompt_lookup:
        raise OptionError("choose one of <draft> and <prompt_lookup>")
    if (self_speculative or skip_layers is not None) and (draft or prompt_lookup):
        raise OptionError("<self_speculative> drafts with the model itself; it does not combine with <draft> or <prompt_lookup>")
    if skip_layers is not None and not skip_layers:
        raise OptionError("<skip_layers> is empty; give the layers to skip, e.g. 3,5,7")
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
