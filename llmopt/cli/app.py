"""The `llmopt` command: global options, the command table, and turning errors into exit codes.

Exit codes: 0 success, 1 a quality gate or check failed, 2 bad input or usage, 3 an internal error.
"""

from __future__ import annotations

import errno
import importlib
import os
import signal
import sys
import traceback
from collections.abc import Iterable
from typing import Annotated, Optional

import typer

import llmopt
from llmopt.cli.common import DeviceOpt, JsonOpt, Settings, VerboseOpt, err
from llmopt.cli.flags import flag
from rich.markup import escape

from llmopt.errors import LlmoptError, OptionError
from llmopt.memory import memory_limits_text  # here, not in the handler: an import can fail once memory is gone

# The command table: each command's module and function (or sub-app), in --help order. A command
# line imports only the command it names (every command for --help, none for --version), so
# `llmopt recommend` does not pay for importing `bench` or `quantize`.
COMMANDS: dict[str, tuple[str, str]] = {
    "inspect": ("llmopt.cli.inspect", "inspect_command"),
    "convert": ("llmopt.cli.convert", "convert_command"),
    "imatrix": ("llmopt.cli.imatrix", "imatrix_command"),
    "generate": ("llmopt.cli.generate", "generate_command"),
    "eval": ("llmopt.cli.eval", "eval_command"),
    "quantize": ("llmopt.cli.quantize", "quantize_command"),
    "recommend": ("llmopt.cli.recommend", "recommend_command"),
    "bench": ("llmopt.cli.bench", "bench_command"),
    "run": ("llmopt.cli.run", "run_command"),
    "manifest": ("llmopt.cli.run", "manifest_app"),
}
_ROOT_OPTIONS_WITH_VALUE = ("--device",)


def build_app(names: Iterable[str] = COMMANDS) -> typer.Typer:
    """The `llmopt` group with the commands `names` (all of them by default)."""
    app = typer.Typer(
        name="llmopt",
        help="Quantize, convert and validate large language models.",
        no_args_is_help=True,
        rich_markup_mode="rich",
        pretty_exceptions_enable=False,
        context_settings={"help_option_names": ["-h", "--help"]},
    )
    app.callback()(root)
    for name in names:
        module, attr = COMMANDS[name]
        command = getattr(importlib.import_module(module), attr)
        if isinstance(command, typer.Typer):
            app.add_typer(command, name=name)
        else:
            app.command(name)(command)
    return app


def command_named(argv: list[str]) -> str | None:
    """The command a command line names (the first word that is not a global option or its value)."""
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in _ROOT_OPTIONS_WITH_VALUE:
            skip = True
        elif not arg.startswith("-"):
            return arg
    return None


def _version(value: bool) -> None:
    if value:
        print(f"llmopt {llmopt.__version__}")
        raise typer.Exit()


def root(
    ctx: typer.Context,
    json_out: JsonOpt = False,
    device: DeviceOpt = None,
    verbose: VerboseOpt = 0,
    version: Annotated[Optional[bool], typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")] = None,
) -> None:
    """Quantize, convert and validate large language models."""
    ctx.obj = Settings(json=json_out, device=device or "auto", verbose=verbose)


class Terminated(BaseException):
    """SIGTERM (a CI timeout, `kill`), raised like Ctrl-C so temporary outputs are discarded on the way out."""


_terminating = False


def _terminate(signum, frame) -> None:
    global _terminating
    _terminating = True  # torch may turn the exception below into its own error on the way out
    raise Terminated


def _discard_unfinished() -> None:
    """The temporaries of outputs left unfinished by a signal (formats/atomic.py), removed on the way out
    (none exist if that module was never loaded)."""
    atomic = sys.modules.get("llmopt.formats.atomic")
    if atomic is not None:
        atomic.discard_unfinished()


def _output_of(argv: list[str]) -> str | None:
    """The value of -o/--output(-dir) on the command line, to name what could not be written."""
    for i, arg in enumerate(argv):
        if arg in ("-o", "--output", "--output-dir") and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(("--output=", "--output-dir=")):
            return arg.split("=", 1)[1]
    return None


# What torch's allocators say when the OS (or a ulimit or cgroup) refuses memory
_ALLOCATION_FAILED = ("can't allocate memory", "CUDA out of memory", "not enough memory")
# Per command, what lowers the memory one call holds
_MEMORY_LEVERS = {"quantize": "<nsamples>, <seqlen> or <batch_size>", "convert": "<nsamples>, <seqlen> or <batch_size>",
                  "imatrix": "<chunks> or <ctx_size>", "eval": "<stream>, <ctx> or <batch>",
                  "generate": "<max_tokens> or <prefill_chunk>", "run": "the recipe's calibration nsamples or seqlen"}  # fmt: skip


def _out_of_memory(command: str | None) -> int:
    """One line for a run the OS refused memory mid-way (the check before work passed: another process
    took the room, or a ulimit the check does not read): what bounds it and what lowers it."""
    _discard_unfinished()
    lever = _MEMORY_LEVERS.get(command or "", "smaller inputs")
    message = OptionError(f"out of memory ({memory_limits_text()}); lower what one call holds: {lever}").render(flag)
    err.print(f"[bold red]error:[/] {escape(message)}", markup=True, soft_wrap=True)
    return 2


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the process's own entry point (not an in-process call): own SIGTERM too
        signal.signal(signal.SIGTERM, _terminate)
    argv = sys.argv[1:] if argv is None else argv
    verbose = any(a in ("-v", "-vv", "--verbose") for a in argv)
    name = command_named(argv)
    try:
        version_only = "--version" in argv and not {"-h", "--help"} & set(argv)
        app = build_app([name] if name in COMMANDS else () if version_only else COMMANDS)
        rv = app(args=argv, prog_name="llmopt", standalone_mode=False)
    except typer.Abort:
        err.print("aborted")
        return 130
    except typer.TyperException as e:  # usage errors: bad options, missing arguments
        if not e.format_message():  # bare `llmopt`: help was printed, nothing to add
            return 2
        hint = f" (try '{e.ctx.command_path} --help')" if getattr(e, "ctx", None) is not None else ""
        err.print(f"[bold red]error:[/] {escape(e.format_message() + hint)}", markup=True, soft_wrap=True)
        return 2
    except LlmoptError as e:
        _discard_unfinished()
        message = e.render(flag) if isinstance(e, OptionError) else str(e)
        err.print(f"[bold red]error:[/] {escape(message)}", markup=True, soft_wrap=True)
        return e.exit_code
    except OSError as e:  # the file system said no (disk full, read-only, ...): the input's fault, not ours
        _discard_unfinished()
        where = e.filename if e.filename is not None else _output_of(argv)
        atomic = sys.modules.get("llmopt.formats.atomic")
        where = atomic.target_of(os.fsdecode(where)) if atomic is not None and where is not None else where
        shown = os.fsencode(where).decode("utf-8", "backslashreplace") if where is not None else "writing"
        reason = e.strerror or f"cannot write ({e})"
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            reason += " (nothing was written under this name; free space and run again)"
        err.print(f"[bold red]error:[/] {escape(f'{shown}: {reason}')}", markup=True, soft_wrap=True)
        return 2
    except MemoryError:  # Python's and numpy's (torch's allocator raises RuntimeError: below)
        return _out_of_memory(name)
    except KeyboardInterrupt:
        _discard_unfinished()
        err.print("interrupted")
        return 130
    except Terminated:
        _discard_unfinished()
        err.print("terminated")
        return 143
    except BaseException as e:  # a bug (or a Rust panic, pyo3's PanicException): one line; -v for the traceback
        if isinstance(e, (SystemExit, GeneratorExit)):
            raise
        if _terminating:
            _discard_unfinished()
            err.print("terminated")
            return 143
        if isinstance(e, RuntimeError) and any(m in str(e) for m in _ALLOCATION_FAILED):
            return _out_of_memory(name)
        if verbose:
            traceback.print_exc()
        err.print(f"[bold red]internal error:[/] {escape(f'{type(e).__name__}: {e}')} (run with -v for the traceback)", markup=True, soft_wrap=True)
        return 3
    return rv if isinstance(rv, int) else 0


if __name__ == "__main__":
    sys.exit(main())
