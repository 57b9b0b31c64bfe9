"""Builds shared across a test run: an export made once per run, by whichever worker asks first (scripts/test.sh
runs two xdist workers), and copied into the outputs of the builds that reuse it."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

def shared_dir(tmp_path_factory) -> Path:
    """A folder every worker of this pytest run sees: the run's basetemp (scripts/test.sh runs two xdist workers,
    each in its own folder inside it). What one run makes once for all its workers goes there (shared_export)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextlib.contextmanager
def exclusive(lock: Path):
    """One process at a time, whichever worker: an exclusive flock on `lock` (created if missing), held for the block."""
    import fcntl

    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield  # closing the file releases it


SHARED_EXPORTS = "shared-exports"


def _shared_export_entry(tmp_path_factory, spec) -> Path:
    """Where this run keeps the export of `spec`: named by what decides an export besides the code and the tool
    versions (the same in every worker of a run), as the export stage's key has it: the checkpoint's content,
    the lowering, the precision, the KV cache dtype and the ranks."""
    from llmc.compiler.hashing import hash_json
    from llmc.compiler.source import inspect_source

    key = hash_json({"source": inspect_source(spec.source).content_hash(), "lowering": str(spec.attention_lowering),
                     "precision": spec.precision.value, "kv_cache_dtype": spec.export.kv_cache_dtype.value,
                     "tensor": spec.parallel.tensor})
    return shared_dir(tmp_path_factory) / SHARED_EXPORTS / key[:24]


def shared_export(tmp_path_factory, spec) -> Path:
    """The `export/` folder of `spec`'s build, made once per test run: by the first worker that asks (a build
    until export, under a lock the other worker waits on) or offered by a test that built it (offer_export);
    nobody writes into it afterwards. Builds reuse it through build_reusing_export."""
    from llmc.compiler import build

    entry = _shared_export_entry(tmp_path_factory, spec)
    with exclusive(entry.with_name(entry.name + ".lock")):
        if not entry.is_dir():  # a build publishes its output whole (compiler/output.py), or not at all
            build(spec, output=entry, until="export")
    return entry / "export"


def offer_export(tmp_path_factory, spec, export: Path) -> None:
    """Keep a copy of the `export/` folder a test built from `spec` as this run's shared export of it, unless
    there is one: later builds of the same graph in any worker reuse it (build_reusing_export)."""
    import shutil

    entry = _shared_export_entry(tmp_path_factory, spec)
    with exclusive(entry.with_name(entry.name + ".lock")):
        if not entry.is_dir():
            staging = entry.with_name(f"{entry.name}.offered-{os.getpid()}")
            shutil.copytree(export, staging / "export")
            staging.rename(entry)


def build_reusing_export(tmp_path_factory, spec, output: Path, **kw):
    """`build(spec, output=output, **kw)` for a test that needs the artifacts, not the export's run: a copy of the
    run's shared export (shared_export) is put in `output` first, as its previous build's export. The pipeline
    reuses a stage whose cache key matches its previous output's (checkpoint hash, code, export settings, tool
    versions), so the export is a cache hit, and a copy whose key does not match is exported over. A copy, not
    hard links: nothing a test does to its output reaches the shared one."""
    import shutil

    from llmc.compiler import build

    export = shared_export(tmp_path_factory, spec)
    if not output.exists():
        shutil.copytree(export, output / "export")
    return build(spec, output=output, **kw)
