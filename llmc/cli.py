"""The `llmc` command line: a thin layer over `llmc.compiler` (and, later, `llmc.runtime`)."""

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


def _friendly(fn):
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


def _run_build(spec_path: Path, output: Optional[Path], until: str, force: set[str]) -> None:
    from llmc.compiler import build, load_spec
    from llmc.console import RichReporter, out, summary_table

    spec = load_spec(spec_path)
    with RichReporter() as reporter:
        result = build(spec, output=output, until=until, force=force, reporter=reporter)
    out.print(summary_table(result))


@app.command()
@_friendly
def build(
    spec: SpecArg,
    output: OutputOpt = None,
    force: Annotated[bool, typer.Option("--force", help="Run every stage, even unchanged ones.")] = False,
) -> None:
    """Build a spec: load the checkpoint, export to ONNX, verify against PyTorch, package a Triton model repository.

    Unchanged stages are reused from the previous output; the output folder is replaced atomically, so a failed or interrupted build leaves the previous one intact.
    """
    _run_build(spec, output, "package", {"export", "verify"} if force else set())


@app.command()
@_friendly
def export(spec: SpecArg, output: OutputOpt = None,
           force: Annotated[bool, typer.Option("--force", help="Export even if unchanged.")] = False) -> None:
    """Export only: checkpoint -> ONNX with explicit KV cache (no verification).

    Attention is lowered as `export.attention` says: `fused` (ONNX Runtime GroupQueryAttention, in-place KV), `reference` (plain opset-23 ops) or `plugin` (TensorRT LlmcFusedAttention node; works with target: tensorrt, which cannot be built further yet).
    """
    _run_build(spec, output, "export", {"export"} if force else set())


@app.command()
@_friendly
def verify(spec: SpecArg, output: OutputOpt = None) -> None:
    """Verify the spec's ONNX export against PyTorch (exports first if needed).

    The HF model runs each prompt alone; the graph runs as serving runs it: each prompt prefilled into its own KV slot, then all rows decoding side by side at their own positions. Prefill plus `verify.decode_steps` greedy steps at batch 1 and for a batch of 3 prompts of different lengths; fails (exit code 5) if any greedy token differs or |Δlogit| exceeds `verify.max_logit_diff`.
    """
    _run_build(spec, output, "verify", {"verify"})


@app.command()
@_friendly
def inspect(path: Annotated[Path, typer.Argument(help="A build folder, a stage folder (export/, verify/) or an .onnx file.", show_default=False)]) -> None:
    """Show what an artifact holds: IO names and shapes, opset, KV layout, hashes, verify results."""
    from llmc.compiler import inspect_path
    from llmc.console import out, sections_table

    for table in sections_table(inspect_path(path)):
        out.print(table)


def _interrupt(signum, frame):  # SIGTERM unwinds like Ctrl-C so staging folders are removed
    raise KeyboardInterrupt


def main() -> None:
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        app()
    except KeyboardInterrupt:  # an interrupt that surfaced outside a command body (e.g. during teardown)
        sys.exit(130)


if __name__ == "__main__":
    sys.exit(main())
