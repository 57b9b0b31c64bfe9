"""The `llmc` application: the Typer app, error handling shared by every command, and `main`."""

from __future__ import annotations

import functools
import signal
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from llmc.errors import LlmcError

app = typer.Typer(
    name="llmc",
    help="Compile HuggingFace causal LMs into verified ONNX artifacts (and serve them on Triton).\n\n"
    "Start with: llmc build model.yaml   (the smallest model.yaml is `name:` and `source:`)",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
)
_state = {"debug": False}

SpecArg = Annotated[Path, typer.Argument(help="The build spec (model.yaml).", show_default=False)]
OutputOpt = Annotated[Optional[Path], typer.Option("--output", "-o", help="Output folder (default: the spec's `output`, else build/<name>).")]


@app.callback()
def _root(debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks for errors.")] = False) -> None:
    _state["debug"] = debug


def friendly(fn):
    """Turn LlmcError into one readable line on stderr and the error's exit code."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from rich.text import Text

        from llmc.console import console

        try:
            return fn(*args, **kwargs)
        except LlmcError as err:
            if _state["debug"]:
                raise
            console.print(Text.assemble(("error: ", "bold red"), str(err)), soft_wrap=True)
            raise typer.Exit(err.exit_code) from None
        except KeyboardInterrupt:
            console.print("[yellow]interrupted[/]: previous output left untouched")
            raise typer.Exit(130) from None

    return wrapper


def _interrupt(signum, frame):  # SIGTERM unwinds like Ctrl-C so staging folders are removed
    raise KeyboardInterrupt


def main() -> None:
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        app()
    except KeyboardInterrupt:  # an interrupt that surfaced outside a command body (e.g. during teardown)
        sys.exit(130)
