"""`evaluate`: perplexity over non-overlapping windows; against a reference, KL divergence and
top-1 agreement; optional quality gates. `evaluate_files` does it for several files against one
reference, with each file's size, and can plot KL divergence against size.

Two paths give the same numbers: a model loaded whole (the runtime's `load_model`), or streamed one
block at a time (`eval/streamed.py`) when the models would not fit in memory (`stream`: None decides
by `_streams`' rule, True or False forces it)."""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from llmopt.device import resolve_device
from llmopt.errors import InputError, OptionError
from llmopt.eval import streamed
from llmopt.eval.gates import NEEDS_REF, Gate, check_gates
from llmopt.eval.pareto import Point, pareto_front, plot_kld_vs_size
from llmopt.eval.perplexity import (EvalResult, evaluate as score_loaded, final_hidden_states, head_log_probs,
                                    in_batches, score, token_windows)
from llmopt.model import ModelSource, TokenizerInfo, open_model
from llmopt.options import EvalOptions
from llmopt.runtime.weights import LoadedModel, check_readable, device_memory, head_tied, load_model, resolve_dtype

Row = tuple[EvalResult, list[Gate], dict[str, Any]]
OnWindow = Callable[[int, int, int], None]  # (model index, done, total)


def evaluate(model: str | Path, data: str | Path, options: EvalOptions | None = None, *,
             ref: str | Path | LoadedModel | None = None, device: str = "auto",
             on_window: Callable[[int, int], None] | None = None, **kwargs: Any) -> Row:  # fmt: skip
    """Score `model` on the first `windows` windows of `ctx` tokens of the text file `data` (the
    options: `EvalOptions`, or keywords; declared in llmopt/options.py).
    `ref` may be a model already loaded (`load`), to score several models against it.
    Returns the result, the gates (perplexity rise in %, top-1 agreement in %, KL in nats) and a
    JSON summary; the caller decides what a failed gate means (the CLI exits 1). `batch` windows
    share each forward (the same numbers up to float rounding). `stream` (None: when the models would
    not fit) runs them one block at a time; `on_window(done, total)` then counts blocks, then windows."""
    o = EvalOptions.merged(options, kwargs)
    _check_gates(ref, o)
    rows, _ = _rows([model], _read(data), data, ref, o, device,
                    None if on_window is None else lambda _i, done, total: on_window(done, total))  # fmt: skip
    return rows[0]


def evaluate_files(models: Sequence[str | Path], data: str | Path, options: EvalOptions | None = None, *,
                   ref: str | Path | None = None, device: str = "auto", plot: str | Path | None = None,
                   on_window: OnWindow | None = None, **kwargs: Any) -> list[Row]:  # fmt: skip
    """`evaluate` for each of `models` against one reference (loaded once, one model in memory
    besides it; or streamed, its final hidden states computed once), each summary with the file's
    size (`bytes`) and bits per weight. With `plot`, a PNG of KL divergence against size, the Pareto
    front joined. `on_window(model_index, done, total)`."""
    o = EvalOptions.merged(options, kwargs)
    if not models:
        raise OptionError("give at least one model to evaluate")
    if plot is not None and ref is None:
        raise OptionError("<plot> draws KL divergence against a reference: give <ref> MODEL")
    _check_gates(ref, o)
    rows, counts = _rows(models, _read(data), data, ref, o, device, on_window)
    for (_, _, summary), count in zip(rows, counts):
        summary["bytes"] = weights_nbytes(Path(summary["model"]))
        summary["bits_per_weight"] = round(8 * summary["bytes"] / count, 3)
    if ref is not None:
        points = [Point(Path(s["model"]).name, s["bytes"], r.kl_divergence) for r, _, s in rows]
        for i in pareto_front(points):
            rows[i][2]["pareto"] = True
        if plot is not None:
            plot_kld_vs_size(points, Path(plot), f"KL divergence from {Path(rows[0][2]['ref']).name}, {Path(data).name}, "
                                                 f"{rows[0][0].windows} x {o.ctx} tokens")  # fmt: skip
    return rows


def _rows(models: Sequence[str | Path], text: str, data: str | Path, ref: str | Path | LoadedModel | None,
          o: EvalOptions, device: str, on_window: OnWindow | None) -> tuple[list[Row], list[int]]:  # fmt: skip
    """Each model's row, and the parameter count its bits per weight divide by (the reference's when
    there is one): by the loaded path or the streamed one (`_streams`)."""
    dev = resolve_device(device)
    dt = resolve_dtype(o.dtype, dev)
    if _streams(models, ref, o, dev, dt):
        return _streamed_rows(models, text, data, ref, o, dev, dt, on_window)
    return _loaded_rows(models, text, data, ref, o, device, on_window)


def streams(models: Sequence[str | Path], ref: str | Path | LoadedModel | None, options: EvalOptions,
            device: str = "auto") -> bool:
    """Whether `evaluate` would run these models one block at a time (`_streams`): a caller that keeps a
    reference between calls (a recipe) loads it only where it would not."""
    dev = resolve_device(device)
    return _streams(models, ref, options, dev, resolve_dtype(options.dtype, dev))


def _streams(models: Sequence[str | Path], ref: str | Path | LoadedModel | None, o: EvalOptions,
             device: torch.device, dtype: torch.dtype) -> bool:  # fmt: skip
    """`stream` when given; else stream when the largest model and the reference, at the eval dtype,
    would take more than 3/4 of the memory available on the device (the rest: activations, logits,
    the allocator). A reference already loaded, or quantized weights asked for, keep the loaded path."""
    if o.stream is not None:
        if o.stream and o.keep_quantized:
            raise OptionError("<stream> runs each block dequantized: it cannot <keep_quantized>")
        return o.stream
    if isinstance(ref, LoadedModel) or o.keep_quantized:
        return False
    largest = max(_parameter_count(m) for m in models)
    weights = (largest + (_parameter_count(ref) if ref is not None else 0)) * dtype.itemsize
    return weights > device_memory(device) * 3 // 4


def _keeps_reference(reference: LoadedModel, windows: torch.Tensor) -> bool:
    """Whether the reference's final hidden states over `windows` take at most 1/8 of the memory available."""
    hidden = windows.numel() * reference.model.arch.hidden_size * reference.dtype.itemsize
    return hidden <= device_memory(reference.device) // 8


def _parameter_count(spec: str | Path) -> int:
    """Weights of a model as its files list them, each stored tensor once (a tied head is the embedding's):
    not the runtime model's parameters, which on CPU hold the linears' weights as buffers."""
    with open_model(spec) as source:
        return source.parameter_count


def _loaded_rows(models: Sequence[str | Path], text: str, data: str | Path, ref: str | Path | LoadedModel | None,
                 o: EvalOptions, device: str, on_window: OnWindow | None) -> tuple[list[Row], list[int]]:  # fmt: skip
    """Each model loaded whole in turn, against the reference loaded once. With several models, the
    reference's final hidden states are computed once where they fit (`_keeps_reference`) and only its head
    runs again per model."""
    reference = ref if ref is None or isinstance(ref, LoadedModel) else load_model(str(ref), o.dtype, device, o.keep_quantized)
    rows, counts, kept = [], [], None
    for i, model in enumerate(models):
        target = load_model(str(model), o.dtype, device, o.keep_quantized)
        windows = _windows(text, o, (target.path, target.tokenizer, target.model.arch.vocab_size),
                           None if reference is None else (reference.path, reference.tokenizer, reference.model.arch.vocab_size))  # fmt: skip
        total = windows.shape[0]
        progress = None if on_window is None else lambda w, i=i: on_window(i, w + 1, total)
        if reference is not None and len(models) > 1 and _keeps_reference(reference, windows):
            if kept is None or not torch.equal(kept[0], windows):
                kept = (windows, final_hidden_states(reference.model, windows, o.batch))
            refs = head_log_probs(reference.model.lm_head, kept[1])
            result = score(windows, in_batches(target.model, windows, o.batch), refs, progress)
        else:
            result = score_loaded(target.model, windows, reference.model if reference else None, progress, o.batch)
        rows.append(_summary(result, o, target.path, reference.path if reference else None, data,
                             target.dtype, target.device, streamed=False))  # fmt: skip
        counts.append(_parameter_count(reference.path if reference else target.path))
        del target
        gc.collect()
    return rows, counts


def _streamed_rows(models: Sequence[str | Path], text: str, data: str | Path, ref: str | Path | LoadedModel | None,
                   o: EvalOptions, device: torch.device, dtype: torch.dtype,
                   on_window: OnWindow | None) -> tuple[list[Row], list[int]]:  # fmt: skip
    """Each model streamed in turn (eval/streamed.py), against the reference's final hidden states,
    computed once (again only if a model's windows differ). Progress counts blocks run, then windows."""
    budget = device_memory(device) // 16  # a head held whole takes at most this; above it, read in slabs
    rows, counts, kept = [], [], None
    with ExitStack() as stack:
        reference = None if ref is None else stack.enter_context(open_model(ref.path if isinstance(ref, LoadedModel) else ref))
        if reference is not None:
            check_readable(reference)
        for i, model in enumerate(models):
            with open_model(model) as source:
                check_readable(source)
                windows = _windows(text, o, (str(source.path), source.tokenizer(), source.arch.vocab_size),
                                   None if reference is None else (str(reference.path), reference.tokenizer(), reference.arch.vocab_size))  # fmt: skip
                redo = reference is not None and (kept is None or not torch.equal(kept.windows, windows))
                steps = source.arch.num_layers + windows.shape[0] + (reference.arch.num_layers if redo else 0)
                done = [0]

                def step(*_: int, i: int = i) -> None:
                    done[0] += 1
                    if on_window is not None:
                        on_window(i, done[0], steps)

                if redo:
                    kept = None  # the previous windows' states go first
                    kept = streamed.stream(reference, windows, _head(reference), dtype, device, o.batch, budget, step)
                target = streamed.stream(source, windows, _head(source), dtype, device, o.batch, budget, step)
                result = score(windows, target.log_probs(), kept.log_probs() if kept else None, on_window=step)
                rows.append(_summary(result, o, str(source.path), None if reference is None else str(reference.path),
                                     data, dtype, device, streamed=True))  # fmt: skip
                counts.append((reference or source).parameter_count)
                del target
    return rows, counts


def _head(source: ModelSource) -> str:
    """The tensor the LM head multiplies by, as the runtime decides it (`head_tied`)."""
    return "model.embed_tokens.weight" if head_tied(source) else "lm_head.weight"


def weights_nbytes(path: Path) -> int:
    """Bytes of a model's weights on disk: a file's size, or a directory's safetensors and GGUF files."""
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.iterdir() if f.suffix in (".safetensors", ".gguf"))


def _check_gates(ref: object, gates: EvalOptions) -> None:
    if any(v is not None for v in (gates.max_ppl_increase, gates.min_top1, gates.max_kld)) and ref is None:
        raise OptionError(NEEDS_REF)


def _read(data: str | Path) -> str:
    try:
        return Path(data).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{data}: cannot read ({e.__class__.__name__})") from None


Named = tuple[str, TokenizerInfo | None, int]  # a model's path, tokenizer and vocabulary size


def _windows(text: str, o: EvalOptions, target: Named, reference: Named | None) -> torch.Tensor:
    """The windows of `text` by the target's tokenizer, once the reference is known to share it."""
    path, tokenizer, vocab = target
    if tokenizer is None:
        raise InputError(f"{path}: has no tokenizer, so it cannot read text")
    chunks = token_windows(tokenizer.encode(text), o.ctx, o.windows)
    if reference is not None:
        ref_path, ref_tokenizer, ref_vocab = reference
        sample = text[:20000]  # both tokenizers on the same text (a cut prefix ends differently from the whole)
        if ref_vocab != vocab or (ref_tokenizer is not None and ref_tokenizer.encode(sample) != tokenizer.encode(sample)):
            raise OptionError(f"<ref> {ref_path}: its tokenizer differs from {path}'s; KL and top-1 need "
                              f"the same vocabulary")  # fmt: skip
    return chunks


def _summary(result: EvalResult, o: EvalOptions, model: str, ref: str | None, data: str | Path, dtype: torch.dtype,
             device: torch.device, streamed: bool) -> Row:  # fmt: skip
    checked = check_gates(result, o.max_ppl_increase, o.min_top1, o.max_kld)
    summary = {"model": model, "ref": ref, "data": str(data), "dtype": str(dtype).removeprefix("torch."),
               "device": str(device), "streamed": streamed, **result.to_dict(), "gates": [g.__dict__ for g in checked],
               "passed": all(g.passed for g in checked)}  # fmt: skip
    return result, checked, summary
