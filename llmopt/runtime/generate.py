"""The generation loop: chunked prefill, then decode (plain or speculative), streaming and timed.

One sequence at a time (batch 1): the interactive case, and the one where a static cache and a
short Python loop matter most. All state lives in the cache and the list of token ids.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from llmopt.errors import InputError, OptionError
from llmopt.model.decoder import Decoder
from llmopt.model.kv_cache import CacheFactory, GenerationCache, StaticKVCache
from llmopt.model.tokenizer import TokenizerInfo
from llmopt.runtime.compiled import CompiledDecoder
from llmopt.runtime.sampling import SamplingConfig, next_token
from llmopt.runtime.speculative import Drafter, accept_drafts
from llmopt.runtime.steps import Steps
from llmopt.runtime.stream import TextStream


@dataclass
class Metrics:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    ttft_ms: float = 0.0  # prompt in -> first new token out (prefill + one sample)
    tpot_ms: float = 0.0  # mean time per output token after the first
    tokens_per_s: float = 0.0  # decode rate after the first token
    drafted_tokens: int | None = None
    accepted_tokens: int | None = None
    acceptance_rate: float | None = None
    target_forwards: int = 0  # forward passes of the target model after prefill
    stop_reason: str = ""  # "eos", "stop", "max_tokens" ("cancelled" in a batch)
    cached_tokens: int | None = None  # prompt tokens whose K/V came from the prefix cache (batch engine)
    skip_layers: list[int] | None = None  # self-speculative: the layers the draft skipped ([]: none used)
    skip_search_s: float | None = None  # self-speculative: the skip-set search's time (before prefill)
    predicted_speedup: float | None = None  # self-speculative: the search's prediction for its set
    compile_s: float | None = None  # --compile: the decode step's compiling, before prefill (None: reused)

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}

    def line(self) -> str:
        parts = [f"prompt {self.prompt_tokens} tok", f"generated {self.generated_tokens} tok",
                 f"TTFT {self.ttft_ms:.1f} ms", f"TPOT {self.tpot_ms:.1f} ms", f"{self.tokens_per_s:.1f} tok/s"]
        if self.drafted_tokens is not None:
            parts.append(f"drafted {self.drafted_tokens}, accepted {self.accepted_tokens} "
                         f"({100 * (self.acceptance_rate or 0):.1f}%)")
        if self.skip_layers is not None:
            searched = "" if self.skip_search_s is None else \
                f" (searched in {self.skip_search_s:.1f} s, predicted {self.predicted_speedup:.2f}x)"
            parts.append(f"skipped layers {','.join(map(str, self.skip_layers)) or 'none'}{searched}")
        if self.compile_s is not None:
            parts.append(f"step compiled in {self.compile_s:.1f} s")
        return " | ".join(parts)


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    metrics: Metrics = field(default_factory=Metrics)


def eos_ids(tok: TokenizerInfo | None, extra: list[int] | None = None) -> set[int]:
    """Tokens that end generation: the tokenizer's EOS, plus any the model's config lists."""
    ids = set(extra or [])
    if tok is not None and tok.token_id(tok.eos_token) is not None:
        ids.add(tok.token_id(tok.eos_token))
    return ids


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Output:
    """One request's output as it grows: appends accepted tokens to `ids`, streams their text, notes
    when the first one came, and says when to stop (EOS, a stop string, `max_tokens`). The
    one-sequence loop and the batch engine both commit through it."""

    def __init__(self, ids: list[int], max_tokens: int, eos: set[int], ignore_eos: bool, stream: TextStream | None,
                 on_text: Callable[[str], None] | None, device: torch.device):
        self.ids, self.max_tokens, self.eos, self.ignore_eos = ids, max_tokens, eos, ignore_eos
        self.stream, self.on_text, self.device = stream, on_text, device
        self.new: list[int] = []
        self.t_first: float | None = None

    def commit(self, tokens: list[int]) -> str | None:
        """Append tokens; return why generation stops, or None to go on."""
        for t in tokens:
            if t in self.eos and not self.ignore_eos:
                return "eos"
            self.ids.append(t)
            self.new.append(t)
            if self.t_first is None:
                _sync(self.device)
                self.t_first = time.perf_counter()
            if self.stream is not None:
                piece = self.stream.push(t)
                if piece and self.on_text:
                    self.on_text(piece)
                if self.stream.stopped:
                    return "stop"
            if len(self.new) >= self.max_tokens:
                return "max_tokens"
        return None

    def result(self, reason: str, metrics: Metrics, t0: float, t_end: float) -> GenerationResult:
        """The text, the new ids and the metrics, timed from `t0` (the request's start) to `t_end`."""
        if self.stream is not None:
            tail = self.stream.finish()
            if tail and self.on_text:
                self.on_text(tail)
        new = self.new
        metrics.stop_reason = reason
        metrics.generated_tokens = len(new)
        first = self.t_first if self.t_first is not None else t_end
        metrics.ttft_ms = 1000 * (first - t0)
        if len(new) > 1:
            metrics.tpot_ms = 1000 * (t_end - first) / (len(new) - 1)
            metrics.tokens_per_s = (len(new) - 1) / max(t_end - first, 1e-9)
        if metrics.drafted_tokens:
            metrics.acceptance_rate = metrics.accepted_tokens / metrics.drafted_tokens
        text = self.stream.text if self.stream is not None else ""
        return GenerationResult(text=text, token_ids=new, metrics=metrics)


class Generator:
    """Runs `model` on one prompt at a time, optionally with a drafter for speculative decoding.

    Each generation gets its KV cache from `cache_factory` (a contiguous `StaticKVCache` by
    default). `compile=True` makes plain decode steps run a torch.compile'd fixed-shape step (CUDA
    graphs on GPU), which then provides the cache it was compiled around."""

    def __init__(self, model: Decoder, tokenizer: TokenizerInfo | None = None, drafter: Drafter | None = None,
                 num_draft: int = 4, prefill_chunk: int = 512, eos: set[int] | None = None, compile: bool = False,
                 cache_factory: CacheFactory = StaticKVCache):
        self.model = model
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.num_draft = num_draft
        self.eos = eos_ids(tokenizer) if eos is None else eos
        self.compiled = CompiledDecoder.for_model(model) if compile else None
        self.steps = Steps(model, prefill_chunk, self.compiled)
        self.device, self.dtype = self.steps.device, self.steps.dtype
        self.cache_factory = self.compiled if self.compiled is not None else cache_factory
        self._cache_long = False  # whether the cache holds keys rotated by longrope's long factors

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor, cache: GenerationCache) -> torch.Tensor:
        """Run the prompt `ids` [n] through the model in chunks; return the logits after its last token."""
        return self.model.lm_head(self.steps.prefill(ids[None], cache)[0, -1]).float()

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_tokens: int = 256, sampling: SamplingConfig = SamplingConfig(),
                 stop: list[str] | tuple[str, ...] = (), seed: int | None = None, ignore_eos: bool = False,
                 on_text: Callable[[str], None] | None = None) -> GenerationResult:
        if not prompt_ids:
            raise InputError("the prompt is empty (no tokens); give some text")
        if max_tokens < 1:
            raise OptionError(f"<max_tokens> must be at least 1, got {max_tokens}")
        sampling.check()
        if stop and self.tokenizer is None:
            raise OptionError("<stop> needs a tokenizer to read the text, and this model has none")
        speculative = self.drafter is not None and self.num_draft > 0
        max_len = len(prompt_ids) + max_tokens + (self.num_draft + 1 if speculative else 1)
        cache = self.cache_factory(self.model.arch, max_len, 1, self.dtype, self.device)
        generator = torch.Generator(self.device)
        generator.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ())))
        stream = TextStream(self.tokenizer, stop) if self.tokenizer is not None else None
        metrics = Metrics(prompt_tokens=len(prompt_ids))
        if self.compiled is not None:
            metrics.compile_s = self.compiled.built_s
        if speculative:
            metrics.drafted_tokens = metrics.accepted_tokens = 0
            self.drafter.begin(cache)

        t0 = time.perf_counter()
        ids = list(prompt_ids)
        logits = self.prefill(torch.tensor(ids, device=self.device), cache)
        self._cache_long = self._long_rope(len(ids))
        token = next_token(logits, sampling, self._history(ids, sampling), generator)
        out = Output(ids, max_tokens, self.eos, ignore_eos, stream, on_text, self.device)
        reason = out.commit([token])
        step = self._speculative_step if speculative else self._plain_step
        while reason is None:
            reason = out.commit(step(ids, cache, sampling, generator, metrics))
        _sync(self.device)
        return out.result(reason, metrics, t0, time.perf_counter())

    def _long_rope(self, end: int) -> bool:
        """Whether a forward ending at `end` takes longrope's long factors (never for other ropes)."""
        switch = self.model.rotary.long_from
        return switch is not None and end > switch

    def _refresh_for_long_rope(self, ids: list[int], cache: GenerationCache, end: int) -> None:
        """The first forward past longrope's original context recomputes the cached keys with the long
        factors, as transformers' Phi-3 generation does (prepare_inputs_for_generation drops its cache
        there), so every later token sees the whole sequence under the long factors."""
        if self._cache_long or not self._long_rope(end):
            return
        self.steps.prefill(torch.tensor([ids[:-1]], device=self.device), cache, reach=end)
        self._cache_long = True

    def _history(self, ids: list[int], sampling: SamplingConfig) -> torch.Tensor:
        """The ids the repetition penalty looks at (none when it is off)."""
        return torch.tensor(ids if sampling.repetition_penalty != 1.0 else [], dtype=torch.long, device=self.device)

    def _plain_step(self, ids: list[int], cache: GenerationCache, sampling: SamplingConfig,
                    generator: torch.Generator, metrics: Metrics) -> list[int]:
        """One forward pass of the last token, one new token."""
        self._refresh_for_long_rope(ids, cache, len(ids))
        logits = self.steps.decode(ids[-1], len(ids) - 1, cache)[0]
        metrics.target_forwards += 1
        return [next_token(logits, sampling, self._history(ids, sampling), generator)]

    def _speculative_step(self, ids: list[int], cache: GenerationCache, sampling: SamplingConfig,
                          generator: torch.Generator, metrics: Metrics) -> list[int]:
        """Draft up to K tokens, verify them in one target forward, return the tokens to keep."""
        assert self.drafter is not None
        n = len(ids)
        drafts, q = self.drafter.propose(ids, self.num_draft, sampling, generator)
        if not drafts:  # nothing to propose (no n-gram match): an ordinary step
            return self._plain_step(ids, cache, sampling, generator, metrics)
        if not self._cache_long and self._long_rope(n + len(drafts)):  # longrope's switch: plain steps over it,
            self.drafter.rollback(n)  # so the tokens stay the plain loop's (no draft kept)
            return self._plain_step(ids, cache, sampling, generator, metrics)
        block = torch.tensor([[ids[-1], *drafts]], device=self.device)
        logits = self.model(block, n - 1, cache)[0].float()  # [K+1, V]
        metrics.target_forwards += 1
        a, token = accept_drafts(logits, ids, drafts, q, sampling, generator)
        metrics.drafted_tokens += len(drafts)
        metrics.accepted_tokens += a
        cache.truncate(n + a)  # ids[-1] and the accepted drafts stay; the rest is overwritten next step
        self.drafter.rollback(n + min(a, max(len(drafts) - 1, 0)))
        return [*drafts[:a], token]
