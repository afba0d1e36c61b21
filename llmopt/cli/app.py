"""The `llmopt` command: global options, the command table, and turning errors into exit codes.

Exit codes: 0 success, 1 a quality gate or check failed, 2 bad input or usage, 3 an internal error.
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
from typing import Annotated, Optional

import typer

import llmopt
from llmopt.cli import bench as bench_cmd
from llmopt.cli import convert, inspect
from llmopt.cli import imatrix as imatrix_cmd
from llmopt.cli import eval as eval_cmd, generate
from llmopt.cli import quantize
from llmopt.cli import recommend
from llmopt.cli import run as run_cmd
from llmopt.cli.common import DeviceOpt, JsonOpt, Settings, VerboseOpt, err
from llmopt.cli.flags import flag
from rich.markup import escape

from llmopt.errors import LlmoptError, OptionError

app = typer.Typer(
    name="llmopt",
    help="Quantize, convert and validate large language models.",
    no_args_is_help=True,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.command("inspect")(inspect.inspect_command)
app.command("convert")(convert.convert_command)
app.command("imatrix")(imatrix_cmd.imatrix_command)
app.command("generate")(generate.generate_command)
app.command("eval")(eval_cmd.eval_command)
app.command("quantize")(quantize.quantize_command)
app.command("recommend")(recommend.recommend_command)
app.command("bench")(bench_cmd.bench_command)
app.command("run")(run_cmd.run_command)
app.add_typer(run_cmd.manifest_app, name="manifest")


def _version(value: bool) -> None:
    if value:
        print(f"llmopt {llmopt.__version__}")
        raise typer.Exit()


@app.callback()
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


def _output_of(argv: list[str]) -> str | None:
    """The value of -o/--output(-dir) on the command line, to name what could not be written."""
    for i, arg in enumerate(argv):
        if arg in ("-o", "--output", "--output-dir") and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(("--output=", "--output-dir=")):
            return arg.split("=", 1)[1]
    return None


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the process's own entry point (not an in-process call): own SIGTERM too
        signal.signal(signal.SIGTERM, _terminate)
    argv = sys.argv[1:] if argv is None else argv
    verbose = any(a in ("-v", "-vv", "--verbose") for a in argv)
    try:
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
        message = e.render(flag) if isinstance(e, OptionError) else str(e)
        err.print(f"[bold red]error:[/] {escape(message)}", markup=True, soft_wrap=True)
        return e.exit_code
    except OSError as e:  # the file system said no (disk full, read-only, ...): the input's fault, not ours
        where = e.filename if e.filename is not None else _output_of(argv)
        shown = os.fsencode(where).decode("utf-8", "backslashreplace") if where is not None else "writing"
        reason = e.strerror or f"cannot write ({e})"
        err.print(f"[bold red]error:[/] {escape(f'{shown}: {reason}')}", markup=True, soft_wrap=True)
        return 2
    except KeyboardInterrupt:
        err.print("interrupted")
        return 130
    except Terminated:
        err.print("terminated")
        return 143
    except BaseException as e:  # a bug (or a Rust panic, pyo3's PanicException): one line; -v for the traceback
        if isinstance(e, (SystemExit, GeneratorExit)):
            raise
        if _terminating:
            err.print("terminated")
            return 143
        if verbose:
            traceback.print_exc()
        err.print(f"[bold red]internal error:[/] {escape(f'{type(e).__name__}: {e}')} (run with -v for the traceback)", markup=True, soft_wrap=True)
        return 3
    return rv if isinstance(rv, int) else 0


if __name__ == "__main__":
    sys.exit(main())
