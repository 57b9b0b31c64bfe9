"""`llmc adapters load|unload|list`: LoRA adapters added to and removed from a served model while it serves, kept in
the model repository's store so every replica serves the same set (llmc/fleet/adapters.py, docs/lora.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from llmc.cli.app import app, friendly

adapters_app = typer.Typer(name="adapters", no_args_is_help=True,
                           help="LoRA adapters of a served model: load, unload, list (docs/lora.md).")
app.add_typer(adapters_app)

RepoOpt = Annotated[str, typer.Option(help="The model repository the replicas serve: a folder, or s3://\\[http://host:port/]bucket/prefix.", show_default=False)]
UrlOpt = Annotated[Optional[list[str]], typer.Option(help="A replica's gRPC address (repeat for each). None: the store only, for replicas that start later.", show_default=False)]
ModelOpt = Annotated[Optional[str], typer.Option(help="The model (default: the repository's only one).")]


def _run(fn, *args, **kwargs) -> dict:
    from llmc.fleet.adapters import AdapterUpdateError
    from llmc.fleet.objectstore import open_store
    from llmc.fleet.store import StoreError

    try:
        return fn(open_store(kwargs.pop("repository")), *args, **kwargs)
    except StoreError as err:
        raise AdapterUpdateError(str(err)) from None


@adapters_app.command("load")
@friendly
def load(
    name: Annotated[str, typer.Argument(help="The adapter's name (what requests give as lora_name, or the OpenAI model).", show_default=False)],
    folder: Annotated[Optional[Path], typer.Argument(help="A PEFT adapter folder (adapter_config.json + adapter_model.safetensors). None: the store's adapter, loaded by the replicas again.", show_default=False)] = None,
    repository: RepoOpt = ..., url: UrlOpt = None, model: ModelOpt = None,
    task_id: Annotated[Optional[int], typer.Option(min=0, help="TensorRT-LLM's lora_task_id requests may name it by.")] = None,
) -> None:
    """Check a PEFT adapter against the served model, write it into the repository's store and load it on every replica."""
    from llmc.console import out
    from llmc.fleet.adapters import load as run

    result = _run(run, model, name, folder, url or [], task_id, repository=repository)
    where = ", ".join(result["replicas"]) or "the store only"
    seconds = [f"{a.get('seconds', 0):.2f} s" for a in result["replicas"].values()]
    out.print(f"[green]loaded[/] {name} ({result['digest'][:12]}) on {result['model']}: {where}"
              + (f" ({', '.join(seconds)})" if seconds else ""))


@adapters_app.command("unload")
@friendly
def unload(
    name: Annotated[str, typer.Argument(help="The adapter's name.", show_default=False)],
    repository: RepoOpt = ..., url: UrlOpt = None, model: ModelOpt = None,
    wait: Annotated[float, typer.Option(min=0, max=600, help="Seconds a replica waits for the requests using the adapter (taking no new ones); 0: refused at once while any does.")] = 0.0,
) -> None:
    """Unload an adapter from every replica, then from the repository's store."""
    from llmc.console import out
    from llmc.fleet.adapters import unload as run

    result = _run(run, model, name, url or [], wait, repository=repository)
    out.print(f"[green]unloaded[/] {name} from {result['model']}: {', '.join(result['replicas']) or 'the store only'}")


@adapters_app.command("list")
@friendly
def listing(repository: RepoOpt = ..., url: UrlOpt = None, model: ModelOpt = None) -> None:
    """The adapters in the repository's store and those each replica serves (JSON)."""
    from llmc.console import out
    from llmc.fleet.adapters import listing as run

    out.print_json(json.dumps(_run(run, model, url or [], repository=repository)))
