"""The `llmc` command line: a thin layer over `llmc.compiler`, `llmc.serve`, `llmc.fleet.deploy` and the
other operator tools. app.py holds the app and what every command shares; the commands are grouped
by what they act on: build.py (build, export, verify, inspect), serving.py (serve, openai, generate,
bench), deploy.py (deploy, k8s), adapters.py (adapters load|unload|list)."""

# importing a group registers its commands, in the order --help lists them
from llmc.cli import build, serving, deploy, adapters  # noqa: F401, I001
from llmc.cli.app import app, main

__all__ = ["app", "main"]
