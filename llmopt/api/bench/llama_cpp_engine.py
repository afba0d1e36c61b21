"""llama.cpp in-process (llama-cpp-python's bindings of its C API) as a benchmark engine.

The same lockstep run as llmopt's engine: B sequences (llama.cpp's sequence ids 0..B-1) prefilled
in chunks of up to 512 tokens each per `llama_decode` call, then one call per step with one token
for each sequence; greedy (argmax of each sequence's logits), EOS ignored. A fresh context per
run, sized for it (n_ctx = B x (P + gen), n_seq_max = B); the GGUF's own tensor types on the CPU.
"""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path

import numpy as np

from llmopt.api.bench.prompts import special_token_ids
from llmopt.api.bench.trace import Trace, peak_rss_bytes, reset_peak_rss
from llmopt.errors import InputError, OptionError
from llmopt.formats.gguf.types import tensor_nbytes
from llmopt.model import open_model
from llmopt.model.gguf_header import read_gguf
from llmopt.plan.kv_cache import kv_bytes_per_token

PREFILL_CHUNK = 512  # tokens of each sequence per llama_decode call, as llmopt's prefill chunk


def _bindings():  # noqa: ANN202
    try:
        import llama_cpp
    except ImportError:
        raise OptionError("<engine> llama.cpp needs llama-cpp-python: pip install llama-cpp-python") from None
    return llama_cpp


_QUIET = None  # the no-op log callback, kept alive while llama.cpp holds it


class LlamaCppEngine:
    name = "llama.cpp"

    def __init__(self, path: str, threads: int = 0):
        global _QUIET
        self.path = Path(path).expanduser()
        if not self.path.is_file() or self.path.suffix.lower() != ".gguf":
            raise InputError(f"{path}: <engine> llama.cpp reads a .gguf file")
        with open_model(self.path) as source:  # llmopt's own checks and tokenizer for the same file
            self.arch = source.arch
            self.tokenizer = source.tokenizer()
        self.llama = _bindings()
        if _QUIET is None:
            _QUIET = self.llama.llama_log_callback(lambda level, text, data: None)
            self.llama.llama_log_set(_QUIET, ctypes.c_void_p(0))
        self.llama.llama_backend_init()
        self.model = self.llama.llama_model_load_from_file(str(self.path).encode(), self.llama.llama_model_default_params())
        if not self.model:
            raise InputError(f"{path}: llama.cpp could not load this GGUF")
        self.vocab_size = self.llama.llama_vocab_n_tokens(self.llama.llama_model_get_vocab(self.model))
        self.context = self.llama.llama_model_n_ctx_train(self.model)
        self.threads = threads or len(os.sched_getaffinity(0))
        self.weight_bytes = gguf_decode_weight_bytes(self.path)
        self.kv_bytes_per_token = kv_bytes_per_token(self.arch, "f16")  # llama.cpp's default cache type
        self.device = "cpu"

    def excluded_ids(self) -> set[int]:
        return special_token_ids(self.tokenizer)

    def run(self, prompts: list[list[int]], gen: int) -> Trace:
        llama = self.llama
        batch, length = len(prompts), len(prompts[0])
        chunk = min(length, PREFILL_CHUNK)
        params = llama.llama_context_default_params()
        params.n_ctx = batch * (length + gen)
        params.n_batch = batch * chunk
        params.n_ubatch = min(params.n_batch, PREFILL_CHUNK)  # llama.cpp splits a batch into these
        params.n_seq_max = batch
        params.n_threads = params.n_threads_batch = self.threads
        ctx = llama.llama_init_from_model(self.model, params)
        if not ctx:
            raise InputError(f"llama.cpp could not create a context for batch {batch} x {length + gen} tokens")
        buf = llama.llama_batch_init(batch * chunk, 0, 1)
        try:
            reset_peak_rss()
            t0 = time.perf_counter()
            for start in range(0, length, chunk):
                last = start + chunk >= length
                entries = [(prompts[s][p], p, s, last and p == length - 1)
                           for s in range(batch) for p in range(start, min(start + chunk, length))]  # fmt: skip
                token = self._decode(ctx, buf, entries)
            tokens = [token]
            ttft = time.perf_counter() - t0
            steps = []
            for i in range(1, gen):
                t = time.perf_counter()
                token = self._decode(ctx, buf, [(token[s], length + i - 1, s, True) for s in range(batch)])
                tokens.append(token)
                steps.append(time.perf_counter() - t)
            return Trace([list(seq) for seq in zip(*tokens)], ttft, steps, peak_rss_bytes())
        finally:
            llama.llama_batch_free(buf)
            llama.llama_free(ctx)

    def _decode(self, ctx, buf, entries: list[tuple[int, int, int, bool]]) -> list[int]:  # noqa: ANN001
        """One llama_decode of (token, position, sequence, wants logits) entries; the argmax of each
        entry that wanted logits, in order."""
        for i, (tok, pos, seq, logits) in enumerate(entries):
            buf.token[i] = tok
            buf.pos[i] = pos
            buf.n_seq_id[i] = 1
            buf.seq_id[i][0] = seq
            buf.logits[i] = logits
        buf.n_tokens = len(entries)
        rc = self.llama.llama_decode(ctx, buf)
        if rc != 0:
            raise InputError(f"llama.cpp's llama_decode failed (code {rc})")
        out = []
        for i, entry in enumerate(entries):
            if entry[3]:
                row = np.ctypeslib.as_array(self.llama.llama_get_logits_ith(ctx, i), shape=(self.vocab_size,))
                out.append(int(row.argmax()))
        return out

    def __del__(self) -> None:
        if getattr(self, "model", None):
            self.llama.llama_model_free(self.model)
            self.model = None


def gguf_decode_weight_bytes(path: Path) -> int:
    """Bytes of a GGUF's tensors one decode step reads: all of them, less the embedding table when
    the file has a separate output matrix (a step looks up a few rows of it)."""
    tensors = read_gguf(path).tensors
    names = {t.name for t in tensors}
    return sum(tensor_nbytes(t.tensor_type.name, tuple(reversed(t.shape))) for t in tensors
               if not (t.name == "token_embd.weight" and "output.weight" in names))  # fmt: skip
