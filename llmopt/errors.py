"""Errors the CLI turns into one-line messages and exit codes (2 = bad input, 1 = a failed check).

The library names what was wrong by its own names: `OptionError` messages refer to settings as
`<field>` (the typed configs' field names, which are also the Python API's keyword arguments).
Shown as a string they read `field` (in backquotes); the CLI shows them as its flags (`--field`),
in one place (llmopt/cli/flags.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable

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
