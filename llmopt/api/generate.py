"""`load` and `generate`: what llmopt wrote (or any model it reads), run by the built-in runtime."""

from __future__ import annotations

import dataclasses
import json
import logging
import time

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmopt.errors import InputError, OptionError
from llmopt.options import GenerateOptions, LoadOptions, quantized_in_memory
from llmopt.runtime.chat import apply_chat_template
from llmopt.runtime.generate import GenerationResult, Generator, Metrics
from llmopt.runtime.sampling import SamplingConfig
from llmopt.runtime.self_speculative import LayerSkipDraft
from llmopt.runtime.skip_search import search_skip_layers
from llmopt.runtime.speculative import DraftModel, PromptLookup
from llmopt.runtime.weights import LoadedModel, load_model


def load(model: str | Path, options: LoadOptions | None = None, *, device: str = "auto", **kwargs: Any) -> LoadedModel:
    """The runtime model of `model`: an HF directory (float or GPTQ), a GGUF file or a hub id.
    `dtype` auto is float32 on CPU and bfloat16 on CUDA. A quantized model's weights (GGUF, GPTQ, AWQ,
    compressed-tensors) stay quantized in memory with `keep_quantized=True` or `compile`, are dequantized
    with `keep_quantized=False`, and by default stay quantized only where dequantized they would not fit
    (runtime.weights.keep_quantized). Loaded for decoding: on CPU the float linears of a file whose weights
    are not float32 hold them in float16 (runtime.weights.half_weights)."""
    o = LoadOptions.merged(options, kwargs)
    return load_model(str(model), o.dtype, device, quantized_in_memory(o.keep_quantized, o.compile), decode=True)


def generate(model: str | Path | LoadedModel, prompt: str, options: GenerateOptions | None = None, *,
             skip_layers: Sequence[int] | None = None, device: str = "auto",
             on_text: Callable[[str], None] | None = None, **kwargs: Any) -> GenerationResult:  # fmt: skip
    """Continue `prompt` (wrapped in the model's chat template with `chat`). The options
    (`GenerateOptions`, or keywords; declared in llmopt/options.py): temperature 0 is greedy; `draft`
    (a smaller model sharing the tokenizer), `prompt_lookup` (n-gram length) or `self_speculative`
    (the model itself with `skip_layers` skipped, searched on the prompt when not given) turn on
    speculative decoding, whose output is exactly the plain decoder's. `on_text` streams the text."""
    o = GenerateOptions.merged(options, kwargs)
    sampling = check_options(o, skip_layers)
    target = model if isinstance(model, LoadedModel) else load(model, o, device=device)
    tok = target.tokenizer
    if tok is None:
        raise OptionError(f"{target.path}: has no tokenizer, so it cannot take a text prompt")
    ids = _encode(tok, prompt, o.chat, o.system)
    max_tokens = _fit_context(len(ids), o.max_tokens, target.model.arch.max_position_embeddings)
    drafter, notes = None, Metrics()
    if o.self_speculative or skip_layers is not None:
        drafter = _layer_skip_drafter(target.model, ids, sampling, o.num_draft, skip_layers, notes)
    elif o.draft:
        d = load(o.draft, o, device=device)
        if d.model.arch.vocab_size != target.model.arch.vocab_size or (d.tokenizer and d.tokenizer.encode(prompt) != tok.encode(prompt)):
            raise OptionError(f"<draft> {o.draft}: its tokenizer differs from the model's; a draft must share the vocabulary")
        drafter = DraftModel(d.model, len(ids) + max_tokens + o.num_draft + 1, d.dtype, d.device)
    elif o.prompt_lookup:
        drafter = PromptLookup(o.prompt_lookup)
    gen = Generator(target.model, tok, drafter, o.num_draft, o.prefill_chunk, compile=o.compile)
    result = gen.generate(ids, max_tokens, sampling, list(o.stop), o.seed, o.ignore_eos, on_text)
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


def generate_batch(model: str | Path | LoadedModel, prompts: Sequence[str | Mapping],
                   options: GenerateOptions | None = None, *, labels: Sequence[str] | None = None,
                   device: str = "auto", **kwargs: Any) -> BatchOutput:  # fmt: skip
    """Continue many prompts at once (continuous batching over a paged KV cache with prefix sharing).
    A prompt is a string or a mapping with "prompt" and any of `REQUEST_KEYS`, which override the
    options' sampling settings for that request. `prefill_chunk` is the token budget of one forward;
    `kv_blocks` 0 sizes the pool for the `max_batch` longest requests at once."""
    from llmopt.runtime.batch import BatchEngine, pool_blocks
    from llmopt.runtime.paged import BlockPool

    o = GenerateOptions.merged(options, kwargs)
    check_options(o)
    labels = list(labels) if labels is not None else [f"prompt {i + 1}" for i in range(len(prompts))]
    entries = [check_request({"prompt": p} if isinstance(p, str) else dict(p), label) for p, label in zip(prompts, labels)]
    target = model if isinstance(model, LoadedModel) else load(model, o, device=device)
    tok = target.tokenizer
    if tok is None:
        raise OptionError(f"{target.path}: has no tokenizer, so it cannot take a text prompt")
    requests = [_request(o, tok, entry, label, target.model.arch.max_position_embeddings) for entry, label in zip(entries, labels)]
    lookahead = o.num_draft + 1 if o.prompt_lookup else 1
    blocks = o.kv_blocks or pool_blocks([len(r.prompt_ids) + r.max_tokens + lookahead for r in requests], o.max_batch,
                                        o.block_size)  # fmt: skip
    pool = BlockPool(target.model.arch, blocks, o.block_size, target.dtype, target.device)
    engine = BatchEngine(target.model, pool, tok, max_batch=o.max_batch, token_budget=o.prefill_chunk,
                         prompt_lookup=o.prompt_lookup, num_draft=o.num_draft)
    t0 = time.perf_counter()
    results = engine.run(requests)
    return BatchOutput(results, time.perf_counter() - t0, engine.forwards, engine.preemptions, blocks, o.block_size)


def _request(o: GenerateOptions, tok, entry: dict, label: str, context: int):  # noqa: ANN001, ANN202
    """One request of a batch: the options' sampling settings with the entry's own over them."""
    from llmopt.runtime.batch import Request

    own = {k: tuple([v] if isinstance(v, str) else v) if k == "stop" else v for k, v in entry.items()
           if k in REQUEST_KEYS and k not in ("prompt", "id")}  # fmt: skip
    try:
        r = dataclasses.replace(o, **own)
        sampling = check_options(r)
        ids = _encode(tok, entry["prompt"], o.chat, o.system)
        max_tokens = _fit_context(len(ids), r.max_tokens, context)
    except OptionError as e:
        raise InputError(f"{label}: {e.render()}") from None
    return Request(ids, max_tokens, sampling, tuple(r.stop), r.seed, r.ignore_eos)


def _encode(tok, prompt: str, chat: bool, system: str | None) -> list[int]:
    """The prompt's token ids (inside the model's chat template with `chat`)."""
    if chat:
        return tok.tokenizer.encode(apply_chat_template(tok, prompt, system), add_special_tokens=False).ids
    return tok.encode(prompt)


def check_options(o: GenerateOptions, skip_layers: Sequence[int] | None = None) -> SamplingConfig:
    """Refuse option combinations `generate` cannot run, before any model is loaded; the sampling config.
    (Each option's own range is checked where it is declared, llmopt/options.py.)"""
    GenerateOptions.of(**o.changed())  # a request's own values (dataclasses.replace) are checked here
    if o.draft and o.prompt_lookup:
        raise OptionError("choose one of <draft> and <prompt_lookup>")
    if (o.self_speculative or skip_layers is not None) and (o.draft or o.prompt_lookup):
        raise OptionError("<self_speculative> drafts with the model itself; it does not combine with <draft> or <prompt_lookup>")
    if skip_layers is not None and not skip_layers:
        raise OptionError("<skip_layers> is empty; give the layers to skip, e.g. 3,5,7")
    if o.system and not o.chat:
        raise OptionError("<system> needs <chat>")
    sampling = SamplingConfig(o.temperature, o.top_k, o.top_p, o.min_p, o.repetition_penalty)
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
