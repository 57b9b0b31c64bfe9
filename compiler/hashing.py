"""Content hashes: what the stage cache keys on and what artifacts record about their inputs."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Iterable

from llmc.compiler.code_closure import code_files

_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def sha256_files(paths: Iterable[Path], root: Path) -> str:
    """One hash over several files, keyed by their path relative to `root` (order-independent)."""
    h = hashlib.sha256()
    for path in sorted(paths, key=lambda p: p.relative_to(root).as_posix()):
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        h.update(sha256_file(path).encode())
    return h.hexdigest()


def hash_json(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


def code_hash(*roots: str) -> str:
    """Hash of the code that modules `roots` run: they and every llmc module they import, directly or not,
    with the C sources and text those load (code_closure.py). A stage's key holds it, so editing the
    exporter, a runner or a kernel invalidates the results it made even before the version number changes."""
    h = hashlib.sha256()
    for label, path in code_files(roots):
        h.update(label.encode() + b"\0" + sha256_file(path).encode())
    return h.hexdigest()
