"""A command's flags from its options' one declaration (llmopt/options.py).

`@with_options(QuantizeOptions)` gives a command function every option of the class as a Typer
parameter (flag, help, default, choices from the declaration); the function takes them in
`**options` and hands them to the API, which checks them. Its own parameters (the model, the output,
what only the CLI has) stay written out in its signature, and any option it names itself is left to
it.
"""

from __future__ import annotations

import functools
import inspect
import types
import typing
from collections.abc import Callable
from enum import Enum
from typing import Annotated, Any, Optional

import typer

from llmopt.options import Declared, Options

# The parameters every command ends with: the options go before them, so --help lists them last.
_TRAILING = ("report", "dry_run", "force", "json_out", "device", "verbose")


def declared_options(*groups: type[Options]) -> list[Declared]:
    """The options of `groups`, each once, in declaration order."""
    seen: dict[str, Declared] = {}
    for group in groups:
        for d in group.declared():
            seen.setdefault(d.name, d)
    return list(seen.values())


def _cli_type(d: Declared) -> Any:
    """The annotation Typer parses the option with: str for choices and sizes, a list for repeatables."""
    args = [a for a in typing.get_args(d.type)] if isinstance(d.type, types.UnionType) else [d.type]
    optional = type(None) in args
    base = next(a for a in args if a is not type(None))
    if typing.get_origin(base) in (tuple, list):
        return Optional[list[str]]
    if d.spec.choices is not None:
        base = _choices(d.name, d.spec.choices)
    elif len(args) - optional > 1:
        base = str  # `str | int` (a size) is parsed from its text
    return Optional[base] if optional else base


@functools.cache
def _choices(name: str, choices: tuple[str, ...]) -> type[Enum]:
    """Typer's way to offer choices (and list them in --help): a str Enum; its values reach the API."""
    return Enum(name, {c: c for c in choices}, type=str)  # type: ignore[return-value]


def _parameter(d: Declared, help_values: dict[str, str]) -> inspect.Parameter:
    names = d.spec.flags or ("--" + d.name.replace("_", "-"),)
    text = d.spec.help
    for key, value in help_values.items():
        text = text.replace("{" + key + "}", value)
    info = typer.Option(*names, help=text, show_default=d.spec.show_default)
    default = None if isinstance(d.default, tuple) else d.default
    return inspect.Parameter(d.name, inspect.Parameter.KEYWORD_ONLY, default=default,
                             annotation=Annotated[_cli_type(d), info])  # fmt: skip


def with_options(*groups: type[Options], help_values: dict[str, str] | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Add the options of `groups` to a command function's Typer signature (see the module doc).
    `help_values` fill the {placeholders} of help texts with what only a higher layer knows."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        hints = typing.get_type_hints(fn, include_extras=True)
        own = [p.replace(annotation=hints.get(p.name, p.annotation), kind=inspect.Parameter.KEYWORD_ONLY)
               for p in inspect.signature(fn).parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]  # fmt: skip
        options = [d for d in declared_options(*groups) if d.name not in {p.name for p in own}]
        repeatable = {d.name for d in options if isinstance(d.default, tuple)}
        chosen = {d.name for d in options if d.spec.choices is not None}
        cut = next((i for i, p in enumerate(own) if p.name in _TRAILING), len(own))
        params = own[:cut] + [_parameter(d, help_values or {}) for d in options] + own[cut:]

        @functools.wraps(fn)
        def command(**kwargs: Any) -> Any:
            for name in repeatable:  # Typer gives None for a repeatable flag not given
                kwargs[name] = tuple(kwargs[name] or ())
            for name in chosen:
                kwargs[name] = kwargs[name].value if isinstance(kwargs[name], Enum) else kwargs[name]
            return fn(**kwargs)

        command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command

    return wrap


def option_values(options: dict[str, Any], group: type[Options]) -> dict[str, Any]:
    """The entries of `options` that are options of `group`, with Path values as given."""
    names = {d.name for d in group.declared()}
    return {k: v for k, v in options.items() if k in names}

