"""`evaluate`: perplexity over non-overlapping windows; against a reference, KL divergence and
top-1 agreement; optional quality gates. `evaluate_files` does it for several files against one
reference, with each file's size, and can plot KL divergence against size."""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from llmopt.errors import InputError, OptionError
from llmopt.eval.gates import NEEDS_REF, Gate, check_gates
from llmopt.eval.pareto import Point, pareto_front, plot_kld_vs_size
from llmopt.eval.perplexity import EvalResult, evaluate as score, token_windows
from llmopt.options import EvalOptions
from llmopt.runtime.weights import LoadedModel, load_model


def evaluate(model: str | Path, data: str | Path, options: EvalOptions | None = None, *,
             ref: str | Path | LoadedModel | None = None, device: str = "auto",
             on_window: Callable[[int, int], None] | None = None, **kwargs: Any) -> tuple[EvalResult, list[Gate], dict[str, Any]]:  # fmt: skip
    """Score `model` on the first `windows` windows of `ctx` tokens of the text file `data` (the
    options: `EvalOptions`, or keywords; declared in llmopt/options.py).
    `ref` may be a model already loaded (`load`), to score several models against it.
    Returns the result, the gates (perplexity rise in %, top-1 agreement in %, KL in nats) and a
    JSON summary; the caller decides what a failed gate means (the CLI exits 1). `batch` windows
    share each forward (the same numbers up to float rounding)."""
    o = EvalOptions.merged(options, kwargs)
    _check_gates(ref, o)
    text = _read(data)
    reference = _reference(ref, o, device)
    return _score(load_model(str(model), o.dtype, device, o.packed), text, data, reference, o, on_window)


def evaluate_files(models: Sequence[str | Path], data: str | Path, options: EvalOptions | None = None, *,
                   ref: str | Path | None = None, device: str = "auto", plot: str | Path | None = None,
                   on_window: Callable[[int, int, int], None] | None = None,
                   **kwargs: Any) -> list[tuple[EvalResult, list[Gate], dict[str, Any]]]:  # fmt: skip
    """`evaluate` for each of `models` against one reference (loaded once; one model in memory
    besides it), each summary with the file's size (`bytes`) and bits per weight. With `plot`, a
    PNG of KL divergence against size, the Pareto front joined. `on_window(model_index, done, total)`."""
    o = EvalOptions.merged(options, kwargs)
    if not models:
        raise OptionError("give at least one model to evaluate")
    if plot is not None and ref is None:
        raise OptionError("<plot> draws KL divergence against a reference: give <ref> MODEL")
    _check_gates(ref, o)
    text = _read(data)
    reference = _reference(ref, o, device)
    params = None if reference is None else _parameters(reference)
    rows = []
    for i, model in enumerate(models):
        target = load_model(str(model), o.dtype, device, o.packed)
        count = params or _parameters(target)
        result, checked, summary = _score(target, text, data, reference, o,
                                          None if on_window is None else lambda d, t, i=i: on_window(i, d, t))  # fmt: skip
        summary["bytes"] = weights_nbytes(Path(target.path))
        summary["bits_per_weight"] = round(8 * summary["bytes"] / count, 3)
        rows.append((result, checked, summary))
        del target
        gc.collect()
    if reference is not None:
        points = [Point(Path(s["model"]).name, s["bytes"], r.kl_divergence) for r, _, s in rows]
        for i in pareto_front(points):
            rows[i][2]["pareto"] = True
        if plot is not None:
            plot_kld_vs_size(points, Path(plot), f"KL divergence from {Path(reference.path).name}, {Path(data).name}, "
                                                 f"{rows[0][0].windows} x {o.ctx} tokens")  # fmt: skip
    return rows


def weights_nbytes(path: Path) -> int:
    """Bytes of a model's weights on disk: a file's size, or a directory's safetensors and GGUF files."""
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.iterdir() if f.suffix in (".safetensors", ".gguf"))


def _parameters(loaded: LoadedModel) -> int:
    """Weights of a float model, each stored tensor once (tied embeddings share theirs)."""
    return sum(p.numel() for p in {p.data_ptr(): p for p in loaded.model.parameters()}.values())


def _check_gates(ref: object, gates: EvalOptions) -> None:
    if any(v is not None for v in (gates.max_ppl_increase, gates.min_top1, gates.max_kld)) and ref is None:
        raise OptionError(NEEDS_REF)


def _reference(ref: str | Path | LoadedModel | None, o: EvalOptions, device: str) -> LoadedModel | None:
    if ref is None or isinstance(ref, LoadedModel):
        return ref
    return load_model(str(ref), o.dtype, device, o.packed)


def _read(data: str | Path) -> str:
    try:
        return Path(data).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{data}: cannot read ({e.__class__.__name__})") from None


def _score(target: LoadedModel, text: str, data: str | Path, reference: LoadedModel | None, o: EvalOptions,
           on_window: Callable[[int, int], None] | None) -> tuple[EvalResult, list[Gate], dict[str, Any]]:  # fmt: skip
    if target.tokenizer is None:
        raise InputError(f"{target.path}: has no tokenizer, so it cannot read text")
    chunks = token_windows(target.tokenizer.encode(text), o.ctx, o.windows)
    if reference is not None:
        sample = text[:20000]  # both tokenizers on the same text (a cut prefix ends differently from the whole)
        if reference.model.arch.vocab_size != target.model.arch.vocab_size or (
                reference.tokenizer is not None and reference.tokenizer.encode(sample) != target.tokenizer.encode(sample)):
            raise OptionError(f"<ref> {reference.path}: its tokenizer differs from {target.path}'s; KL and top-1 need "
                              f"the same vocabulary")  # fmt: skip
    total = chunks.shape[0]
    result = score(target.model, chunks, reference.model if reference else None,
                   on_window=None if on_window is None else lambda i: on_window(i + 1, total), batch=o.batch)  # fmt: skip
    checked = check_gates(result, o.max_ppl_increase, o.min_top1, o.max_kld)
    summary = {"model": target.path, "ref": reference.path if reference else None, "data": str(data),
               "dtype": str(target.dtype).removeprefix("torch."), "device": str(target.device),
               **result.to_dict(), "gates": [g.__dict__ for g in checked], "passed": all(g.passed for g in checked)}  # fmt: skip
    return result, checked, summary
