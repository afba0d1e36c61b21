"""`--chat`: render the model's own chat template (tokenizer_config.json or GGUF metadata).

Templates are Jinja2, rendered in a sandbox with the variables and helpers that HF templates use
(`messages`, `add_generation_prompt`, `bos_token`, `eos_token`, `raise_exception`). A template is
input like any other, so its rendering is bounded: `range` yields at most `MAX_RANGE` items, a
string repeated by `*` may not exceed `MAX_OUTPUT` characters, the text it produces may not
either, and rendering stops after `MAX_SECONDS` (between output pieces, and by a timer when the
caller runs on the main thread, as the CLI does).
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import date
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from llmopt.errors import OptionError
from llmopt.model.tokenizer import TokenizerInfo

MAX_RANGE = 10_000  # no chat template loops further over one range; jinja's sandbox allows 100,000
MAX_OUTPUT = 1_000_000  # characters
MAX_SECONDS = 2.0


class _Limited(TemplateError):
    pass


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset(["*", "**"])

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*" and isinstance(right, int) and isinstance(left, (str, list)) or \
                operator == "*" and isinstance(left, int) and isinstance(right, (str, list)):  # fmt: skip
            seq, n = (left, right) if isinstance(right, int) else (right, left)
            if len(seq) * max(n, 0) > MAX_OUTPUT:
                raise _Limited(f"a repetition of {len(seq) * n} items (the limit is {MAX_OUTPUT})")
        if operator == "**" and isinstance(right, (int, float)) and abs(right) > 64:
            raise _Limited(f"an exponent of {right}")
        return super().call_binop(context, operator, left, right)


def _range(*args: int) -> range:
    r = range(*args)
    if len(r) > MAX_RANGE:
        raise _Limited(f"a range of {len(r)} items (the limit is {MAX_RANGE})")
    return r


def _raise(message: str) -> None:
    raise TemplateError(message)


def apply_chat_template(tok: TokenizerInfo, prompt: str, system: str | None = None) -> str:
    """The prompt text for one user turn (and an optional system turn), ready for the assistant."""
    if not tok.chat_template:
        raise OptionError("<chat>: this model has no chat template (none in tokenizer_config.json or GGUF metadata)")
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    env = _BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: date.today().strftime(fmt)
    env.globals["range"] = _range
    try:
        template = env.from_string(tok.chat_template)
        pieces, size, deadline = [], 0, time.monotonic() + MAX_SECONDS
        with _timer(MAX_SECONDS):
            for piece in template.generate(messages=messages, add_generation_prompt=True, bos_token=tok.bos_token or "",
                                           eos_token=tok.eos_token or ""):  # fmt: skip
                size += len(piece)
                if size > MAX_OUTPUT:
                    raise _Limited(f"more than {MAX_OUTPUT} characters of output")
                if time.monotonic() > deadline:
                    raise _Limited(f"more than {MAX_SECONDS:g} s")
                pieces.append(piece)
        return "".join(pieces)
    except _Limited as e:
        raise OptionError(f"<chat>: the model's chat template was stopped: {e}") from None
    except TemplateError as e:
        raise OptionError(f"<chat>: the model's chat template failed: {e}") from None
    except (RecursionError, MemoryError, OverflowError, TypeError, ValueError) as e:
        raise OptionError(f"<chat>: the model's chat template failed: {type(e).__name__}: {str(e)[:120]}") from None


@contextmanager
def _timer(seconds: float) -> Iterator[None]:
    """Raise _Limited in the main thread after `seconds` (a template that loops without output)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise _Limited(f"more than {seconds:g} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
