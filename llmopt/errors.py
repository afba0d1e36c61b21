"""Errors the CLI turns into one-line messages and exit codes (2 = bad input, 1 = a failed check).

The library names what was wrong by its own names: `OptionError` messages refer to settings as
`<field>` (the typed configs' field names, which are also the Python API's keyword arguments).
Shown as a string they read `field` (in backquotes); the CLI shows them as its flags (`--field`),
in one place (llmopt/cli/flags.py).
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Callable
from typing import Any

_FIELD = re.compile(r"<([a-z_][a-z0-9_]*)>")


class LlmoptError(Exception):
    """Base class: a problem we can explain to the user in one line."""

    exit_code = 2


class InputError(LlmoptError):
    """The user gave us something we cannot read or do not support."""

    exit_code = 2


class OptionError(InputError):
    """A bad value of one or more settings, named in the message as `<field>`."""

    def __init__(self, template: str):
        self.template = template
        super().__init__(self.render())

    @property
    def fields(self) -> list[str]:
        return _FIELD.findall(self.template)

    def render(self, name: Callable[[str], str] = lambda field: f"`{field}`") -> str:
        """The message with every `<field>` replaced by `name(field)`."""
        return _FIELD.sub(lambda m: name(m.group(1)), self.template)


class CheckFailed(LlmoptError):
    """A quality gate or verification failed (the input was fine; the result was not)."""

    exit_code = 1


def guarded(call: Callable[[], Any], what: str, quiet: bool = True) -> Any:
    """`call()` into a Rust-backed library (tokenizers, safetensors) on input we were given, with
    what it raises on malformed input as one InputError naming `what`: bare Exceptions, and Rust
    panics (pyo3's PanicException, a BaseException that `except Exception` lets through). With
    `quiet`, stderr is held during the call: a panic prints its message (and, with RUST_BACKTRACE,
    a backtrace) there, which is dropped; anything else the call printed is passed on."""
    held = _HeldStderr() if quiet else None
    try:
        result = call()
    except LlmoptError:
        raise
    except Exception as e:
        raise InputError(f"{what} ({str(e).splitlines()[0][:120] if str(e) else type(e).__name__})") from None
    except BaseException as e:
        if not is_panic(e):
            raise
        if held is not None:
            held.release(replay=False)
            held = None
        raise InputError(f"{what} ({str(e).splitlines()[0][:120]})") from None
    finally:
        if held is not None:
            held.release(replay=True)
    return result


class _HeldStderr:
    """File descriptor 2 pointed at a temporary file until `release` (which may copy it back)."""

    def __init__(self) -> None:
        sys.stderr.flush()
        self.saved = os.dup(2)
        self.file = tempfile.TemporaryFile()
        os.dup2(self.file.fileno(), 2)

    def release(self, replay: bool) -> None:
        os.dup2(self.saved, 2)
        os.close(self.saved)
        if replay:
            self.file.seek(0)
            data = self.file.read()
            if data:
                os.write(2, data)
        self.file.close()


def is_panic(e: BaseException) -> bool:
    """A Rust panic surfaced by pyo3 (tokenizers, safetensors)."""
    return type(e).__name__ == "PanicException"
