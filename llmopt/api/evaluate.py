"""`evaluate`: perplexity over non-overlapping windows; against a reference, KL divergence and
top-1 agreement; optional quality gates."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmopt.errors import InputError, OptionError
from llmopt.eval.gates import Gate, check_gates
from llmopt.eval.perplexity import EvalResult, evaluate as score, token_windows
from llmopt.runtime.weights import load_model


def evaluate(model: str | Path, data: str | Path, *, ref: str | Path | None = None, ctx: int = 512, windows: int = 40,
             max_ppl_increase: float | None = None, min_top1: float | None = None, dtype: str = "auto",
             device: str = "auto", packed: bool = False,
             on_window: Callable[[int, int], None] | None = None) -> tuple[EvalResult, list[Gate], dict[str, Any]]:  # fmt: skip
    """Score `model` on the first `windows` windows of `ctx` tokens of the text file `data`.
    Returns the result, the gates (perplexity rise in %, top-1 agreement in %) and a JSON summary;
    the caller decides what a failed gate means (the CLI exits 1)."""
    if (max_ppl_increase is not None or min_top1 is not None) and ref is None:
        raise OptionError("<max_ppl_increase> and <min_top1> compare against a reference: give <ref> MODEL")
    try:
        text = Path(data).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{data}: cannot read ({e.__class__.__name__})") from None
    target = load_model(str(model), dtype, device, packed)
    if target.tokenizer is None:
        raise InputError(f"{model}: has no tokenizer, so it cannot read text")
    chunks = token_windows(target.tokenizer.encode(text), ctx, windows)
    reference = None
    if ref is not None:
        reference = load_model(str(ref), dtype, device, packed)
        sample = text[:20000]  # both tokenizers on the same text (a cut prefix ends differently from the whole)
        if reference.model.arch.vocab_size != target.model.arch.vocab_size or (
                reference.tokenizer is not None and reference.tokenizer.encode(sample) != target.tokenizer.encode(sample)):
            raise OptionError(f"<ref> {ref}: its tokenizer differs from the model's; KL and top-1 need the same vocabulary")
    total = chunks.shape[0]
    result = score(target.model, chunks, reference.model if reference else None,
                   on_window=None if on_window is None else lambda i: on_window(i + 1, total))  # fmt: skip
    gates = check_gates(result, max_ppl_increase, min_top1)
    summary = {"model": target.path, "ref": reference.path if reference else None, "data": str(data),
               "dtype": str(target.dtype).removeprefix("torch."), "device": str(target.device),
               **result.to_dict(), "gates": [g.__dict__ for g in gates], "passed": all(g.passed for g in gates)}  # fmt: skip
    return result, gates, summary
