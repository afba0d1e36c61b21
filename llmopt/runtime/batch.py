"""Continuous batching: many requests through one model at once, over a paged KV cache.

Each `step` the scheduler picks work under a token budget (vLLM's continuous batching with chunked
prefill): every running sequence brings its next tokens (one for a decode step, one plus its drafts
with prompt-lookup speculation, a chunk of its prompt while it prefills), and waiting requests are
admitted while the batch has room, the budget has tokens left and the pool has blocks for their
first chunk. A new request first takes whatever full blocks of its prompt the prefix cache already
holds and prefills only the rest. The chosen tokens run as one packed forward (`decoder.Packed`:
per-token positions and cache slots, attention only within each sequence), the LM head runs only
on the rows that sample, and each sequence samples with its own settings and its own seeded
generator, so a request's output does not depend on what it was batched with.

When the pool runs out of blocks, the newest running sequence is preempted: its blocks go back and
it waits at the front of the queue; when readmitted it recomputes its prompt and what it had
generated (most of which the prefix cache usually still holds) and goes on where it stopped.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from llmopt.errors import InputError, OptionError
from llmopt.model.decoder import Decoder
from llmopt.model.tokenizer import TokenizerInfo
from llmopt.runtime.generate import GenerationResult, Metrics, Output, eos_ids
from llmopt.runtime.paged import BlockPool, chain_hash, pack, prefix_hashes
from llmopt.runtime.sampling import SamplingConfig, next_token
from llmopt.runtime.speculative import PromptLookup, accept_drafts
from llmopt.runtime.stream import TextStream


@dataclass(frozen=True)
class Request:
    """One prompt (token ids) and how to continue it."""

    prompt_ids: tuple[int, ...] | list[int]
    max_tokens: int = 256
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False


class Sequence:
    """A request in flight: its ids, how many of them have K/V in the cache, its blocks, its output."""

    def __init__(self, index: int, request: Request, engine: BatchEngine):
        self.index, self.request = index, request
        self.ids = list(request.prompt_ids)
        self.computed = 0  # ids[:computed] have K/V in the cache
        self.blocks: list[int] = []  # block table
        self.hashes: list[bytes] = []  # names of the leading blocks that are full (shared or registered)
        self.generator = torch.Generator(engine.device)
        self.generator.manual_seed(request.seed if request.seed is not None else int(torch.randint(0, 2**62, ())))
        stream = TextStream(engine.tokenizer, request.stop) if engine.tokenizer is not None else None
        self.output = Output(self.ids, request.max_tokens, engine.eos, request.ignore_eos, stream, None, engine.device)
        self.metrics = Metrics(prompt_tokens=len(self.ids))
        if engine.drafter is not None:
            self.metrics.drafted_tokens = self.metrics.accepted_tokens = 0
        self.t0 = time.perf_counter()


@dataclass
class Work:
    """What one sequence runs in this step's forward."""

    seq: Sequence
    tokens: list[int]
    drafts: list[int] = field(default_factory=list)


class BatchEngine:
    """Runs many requests at once: `add` them (any time), call `step` until `busy` is False; or `run`.

    `token_budget` bounds the tokens of one forward (prefill chunks and decode steps together);
    `max_batch` the sequences running at once. `prompt_lookup` (an n-gram length) turns on
    prompt-lookup speculation per sequence."""

    def __init__(self, model: Decoder, pool: BlockPool, tokenizer: TokenizerInfo | None = None, *, max_batch: int = 16,
                 token_budget: int = 512, prompt_lookup: int = 0, num_draft: int = 4, eos: set[int] | None = None):
        if max_batch < 1:
            raise OptionError(f"<max_batch> must be at least 1, got {max_batch}")
        if token_budget < 1:
            raise OptionError(f"<prefill_chunk> must be at least 1, got {token_budget}")
        self.model, self.pool, self.tokenizer = model, pool, tokenizer
        self.max_batch, self.token_budget = max_batch, token_budget
        self.drafter = PromptLookup(prompt_lookup) if prompt_lookup > 0 else None
        self.num_draft = num_draft
        self.eos = eos_ids(tokenizer) if eos is None else eos
        param = next(model.parameters())
        self.device = param.device
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the newest is preempted first
        self.active: dict[int, Sequence] = {}
        self.next_index = 0
        self.preemptions = 0
        self.forwards = 0

    @property
    def busy(self) -> bool:
        return bool(self.active)

    def add(self, request: Request) -> int:
        """Queue a request; returns its index (results come back under it)."""
        if not request.prompt_ids:
            raise InputError("the prompt is empty (no tokens); give some text")
        if request.max_tokens < 1:
            raise OptionError(f"<max_tokens> must be at least 1, got {request.max_tokens}")
        request.sampling.check()
        if request.stop and self.tokenizer is None:
            raise OptionError("<stop> needs a tokenizer to read the text, and this model has none")
        need = blocks_for(len(request.prompt_ids) + request.max_tokens + self.lookahead, self.pool.block_size)
        if need > self.pool.num_blocks:
            raise OptionError(f"a request of {len(request.prompt_ids)} prompt tokens and {request.max_tokens} new ones needs "
                              f"{need} KV blocks; the pool has {self.pool.num_blocks} (raise <kv_blocks>)")
        seq = Sequence(self.next_index, request, self)
        self.next_index += 1
        self.active[seq.index] = seq
        self.waiting.append(seq)
        return seq.index

    @property
    def lookahead(self) -> int:
        """Cache positions a step may write past the last token (rejected drafts)."""
        return self.num_draft + 1 if self.drafter is not None else 1

    def cancel(self, index: int) -> GenerationResult:
        """Stop a request now; its blocks go back to the pool. Returns what it had produced."""
        seq = self.active[index]
        if seq in self.waiting:
            self.waiting.remove(seq)
        return self._finish(seq, "cancelled")

    def run(self, requests: list[Request]) -> list[GenerationResult]:
        """Every request to the end; results in the order given."""
        indices = [self.add(r) for r in requests]
        done: dict[int, GenerationResult] = {}
        while self.busy:
            done.update(self.step())
        return [done[i] for i in indices]

    @torch.inference_mode()
    def step(self) -> dict[int, GenerationResult]:
        """One packed forward over the scheduled work; returns the requests that finished in it."""
        work = self._schedule()
        if not work:
            return {}
        packed = pack(self.pool, [(w.seq.blocks, w.seq.computed, len(w.tokens)) for w in work],
                      self.model.arch.sliding_window, self.device)
        ids = torch.tensor([t for w in work for t in w.tokens], device=self.device)
        hidden = self.model.hidden(ids[None], packed, self.pool)[0]
        self.forwards += 1
        rows, offset = [], 0  # the rows that sample: a caught-up sequence's last token, or every verified one
        for w in work:
            end = offset + len(w.tokens)
            if w.drafts:
                rows.extend(range(offset, end))
            elif w.seq.computed + len(w.tokens) == len(w.seq.ids):
                rows.append(end - 1)
            offset = end
        logits = self.model.lm_head(hidden[rows]).float() if rows else None
        finished, row = {}, 0
        for w in work:
            seq = w.seq
            if w.drafts:
                n = len(w.tokens)
                reason = self._verify(w, logits[row:row + n])
                row += n
            elif seq.computed + len(w.tokens) == len(seq.ids):
                seq.computed += len(w.tokens)
                history = seq.ids if seq.request.sampling.repetition_penalty != 1.0 else []
                token = next_token(logits[row], seq.request.sampling, torch.tensor(history, dtype=torch.long,
                                   device=self.device), seq.generator)
                row += 1
                seq.metrics.target_forwards += 1
                reason = seq.output.commit([token])
            else:  # a prefill chunk that has not reached the end yet
                seq.computed += len(w.tokens)
                reason = None
            self._register(seq)
            if reason is not None:
                finished[seq.index] = self._finish(seq, reason)
        return finished

    def _verify(self, w: Work, logits: torch.Tensor) -> str | None:
        """Keep the drafts the target agrees with (the rejection rule), and one token after them."""
        seq = w.seq
        n = len(seq.ids)
        a, token = accept_drafts(logits, seq.ids, w.drafts, None, seq.request.sampling, seq.generator)
        seq.computed = n + a  # ids[-1] and the accepted drafts; the rest of the written slots are stale
        seq.metrics.target_forwards += 1
        seq.metrics.drafted_tokens += len(w.drafts)
        seq.metrics.accepted_tokens += a
        return seq.output.commit([*w.drafts[:a], token])

    def _schedule(self) -> list[Work]:
        budget = self.token_budget
        work: list[Work] = []
        for seq in list(self.running):  # oldest first
            if budget == 0:
                break
            if seq not in self.running:  # preempted below to make room for an older one
                continue
            w = self._next_work(seq, budget)
            while not self._reserve(seq, seq.computed + len(w.tokens)):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                work.append(w)
                budget -= len(w.tokens)
        while self.waiting and budget > 0 and len(self.running) < self.max_batch:
            seq = self.waiting[0]
            if not self._admit(seq, budget):
                break
            self.waiting.popleft()
            self.running.append(seq)
            w = self._next_work(seq, budget)
            work.append(w)
            budget -= len(w.tokens)
        return work

    def _next_work(self, seq: Sequence, budget: int) -> Work:
        if len(seq.ids) - seq.computed > 1:  # prefill (or recompute after preemption): the next chunk
            return Work(seq, seq.ids[seq.computed:seq.computed + budget])
        if self.drafter is not None and budget > 1:
            drafts, _ = self.drafter.propose(seq.ids, min(self.num_draft, budget - 1), seq.request.sampling, seq.generator)
            if drafts:
                return Work(seq, [seq.ids[-1], *drafts], drafts)
        return Work(seq, [seq.ids[-1]])

    def _reserve(self, seq: Sequence, positions: int) -> bool:
        """Grow `seq`'s block table to hold `positions` tokens, if the pool has the blocks."""
        need = blocks_for(positions, self.pool.block_size) - len(seq.blocks)
        if need <= 0:
            return True
        blocks = self.pool.allocate(need)
        if blocks is None:
            return False
        seq.blocks.extend(blocks)
        return True

    def _admit(self, seq: Sequence, budget: int) -> bool:
        """Take the cached prefix of `seq`'s ids and blocks for its first chunk, or nothing at all.
        At least one token is always computed: its logits give the next token."""
        bs = self.pool.block_size
        hashes = prefix_hashes(seq.ids, bs, (len(seq.ids) - 1) // bs)
        seq.blocks = self.pool.lookup(hashes)
        seq.hashes = hashes[:len(seq.blocks)]
        seq.computed = len(seq.blocks) * bs
        if self._reserve(seq, min(len(seq.ids), seq.computed + budget)):
            if seq.metrics.cached_tokens is None:
                seq.metrics.cached_tokens = seq.computed
            return True
        self._drop_blocks(seq)
        return False

    def _register(self, seq: Sequence) -> None:
        """Name the blocks `seq` has just filled, so later prompts can share them."""
        bs = self.pool.block_size
        for i in range(len(seq.hashes), min(seq.computed, len(seq.ids)) // bs):
            name = chain_hash(seq.hashes[-1] if seq.hashes else b"", seq.ids[i * bs:(i + 1) * bs])
            self.pool.register(seq.blocks[i], name)
            seq.hashes.append(name)

    def _drop_blocks(self, seq: Sequence) -> None:
        self.pool.release(seq.blocks)
        seq.blocks, seq.hashes, seq.computed = [], [], 0

    def _preempt(self, seq: Sequence) -> None:
        """Free the blocks of `seq` and put it first in the queue; readmitted, it recomputes them."""
        self._drop_blocks(seq)
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def _finish(self, seq: Sequence, reason: str) -> GenerationResult:
        self._drop_blocks(seq)
        if seq in self.running:
            self.running.remove(seq)
        del self.active[seq.index]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return seq.output.result(reason, seq.metrics, seq.t0, time.perf_counter())


def blocks_for(positions: int, block_size: int) -> int:
    return -(-positions // block_size)


def pool_blocks(lengths: list[int], max_batch: int, block_size: int) -> int:
    """Blocks for the `max_batch` longest sequences at once (`lengths`: prompt + new tokens + lookahead
    of each request): enough that nothing is ever preempted."""
    needs = sorted((blocks_for(n, block_size) for n in lengths), reverse=True)
    return max(1, sum(needs[:max_batch]))
