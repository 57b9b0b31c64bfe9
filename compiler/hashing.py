"""Content hashes: what the stage cache keys on and what artifacts record about their inputs."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Iterable

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


CODE_SUFFIXES = (".py", ".c", ".h", ".txt")  # what a package's folder holds that decides what it computes:
# modules, the C sources of the CPU kernels (compiled on first use), the built-in text it calibrates and measures on


def code_files(name: str) -> list[tuple[str, Path]]:
    """The files of module or package `name`, each with the name it is hashed under: a module's file;
    a package's whole folder, subfolders included (every module, C source, header and text file)."""
    import importlib.util

    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.origin, name
    if not spec.submodule_search_locations:
        return [(name, Path(spec.origin))]
    files = []
    for folder in map(Path, spec.submodule_search_locations):
        files += [(f"{name}/{p.relative_to(folder).as_posix()}", p) for p in folder.rglob("*")
                  if p.suffix in CODE_SUFFIXES and p.is_file() and "__pycache__" not in p.parts]
    return files


def code_hash(*names: str) -> str:
    """Hash of the code of the named modules and packages (a package: its whole folder, C sources
    included): a stage's key holds the code that runs it, so editing the exporter, a runner or a
    kernel invalidates the results it made even before the version number changes."""
    h = hashlib.sha256()
    for label, path in sorted(f for name in set(names) for f in code_files(name)):
        h.update(label.encode() + b"\0" + sha256_file(path).encode())
    return h.hexdigest()
