"""A stage's code, derived: the modules its declaration imports, transitively, and the files they load.

A stage's cache key holds the code that computes its result (pipeline/run.py: cache_key). A list of modules
kept by hand drifted (verify's lacked the LongRoPE tables its reference decode uses), so the list is now
computed: start from the modules that define the stage's functions, follow every import statement inside
llmc (function-local ones too: the compiler imports torch and its own heavy modules lazily), and add the data
files each module sits beside (the CPU kernels' C sources, the built-in corpus).

What counts as an edge, in the module's source:
- `import llmc.a.b` and `from llmc.a import b`: the module `llmc.a.b` when it is one, else the package
  `llmc.a` (its `__init__`), whose name `b` is;
- relative imports, resolved against the importing module's package;
- a string constant naming a module, as `"llmc.runtime.runners.parallel.trt_rank:TrtRankRunner"` (a class a worker
  process imports by name).
A package's `__init__` is not added when only one of its submodules is imported: `from llmc.compiler import
hashing` does not make every stage depend on the library API's `__init__`.

Written by hand because grimp (import-linter's graph, in the test extra) walks one folder per package, while
llmc's package-dir mapping spreads one import root over five folders, and a build needs no lint tool; a test
checks that every import grimp finds is found here too (tests/compiler/pipeline/test_code_closure.py).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import re
from pathlib import Path
from typing import Iterable

ROOT = "llmc"  # the import root whose modules are followed (a test points it at a package of its own)
DATA_SUFFIXES = (".c", ".h", ".txt")  # what a module's folder holds that it loads: C compiled on first use, text
_DOTTED = re.compile(r"^\w+(\.\w+)+(:\w+)?$")  # "package.module" or "package.module:Name"


@functools.lru_cache(maxsize=None)
def locate(name: str) -> Path | None:
    """The file of module `name` inside the import root: a module's `.py`, a package's `__init__.py`; None
    when there is none. Only the import root's top-level packages are imported to find their folders."""
    parts = name.split(".")
    if len(parts) <= 2:
        spec = importlib.util.find_spec(name)
        return Path(spec.origin) if spec is not None and spec.origin else None
    parent = locate(".".join(parts[:-1]))
    if parent is None or parent.name != "__init__.py":
        return None
    for candidate in (parent.parent / f"{parts[-1]}.py", parent.parent / parts[-1] / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _absolute(module: str | None, level: int, package: str) -> str:
    if not level:
        return module or ""
    base = package.split(".")[: len(package.split(".")) - level + 1]
    return ".".join([*base, module] if module else base)


def _inside(name: str) -> bool:
    return name == ROOT or name.startswith(ROOT + ".")


@functools.lru_cache(maxsize=None)
def _imports(name: str, path: Path, mtime_ns: int) -> frozenset[str]:
    """The modules inside the import root that module `name` (at `path`) imports anywhere in its source."""
    package, found = _package_of(name, path), set()
    try:
        tree = ast.parse(path.read_bytes(), str(path))
    except SyntaxError:  # it cannot run, so it imports nothing; its bytes still enter the hash
        return frozenset()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(node.module, node.level, package)
            for alias in node.names:
                child = f"{source}.{alias.name}"
                found.add(child if _inside(child) and locate(child) is not None else source)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _DOTTED.match(node.value):
            found.add(node.value.partition(":")[0])
    return frozenset(n for n in found if _inside(n) and n != name and locate(n) is not None)


def imports(name: str) -> frozenset[str]:
    path = locate(name)
    assert path is not None, f"{name} is not a module inside {ROOT}"
    return _imports(name, path, path.stat().st_mtime_ns)


def closure(roots: Iterable[str]) -> frozenset[str]:
    """`roots` and every module inside the import root they import, directly or not."""
    seen: set[str] = set()
    todo = [r for r in roots if _inside(r)]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(imports(name) - seen)
    return frozenset(seen)


def data_files(module_file: Path) -> list[Path]:
    """The files a module loads from beside it: data in its folder and in subfolders that are not packages."""
    found, folders = [], [module_file.parent]
    while folders:
        folder = folders.pop()
        for entry in folder.iterdir():
            if entry.is_file() and entry.suffix in DATA_SUFFIXES:
                found.append(entry)
            elif entry.is_dir() and entry.name != "__pycache__" and not (entry / "__init__.py").exists():
                folders.append(entry)
    return found


def code_files(roots: Iterable[str]) -> list[tuple[str, Path]]:
    """What the closure of `roots` runs, each file with the name it is hashed under (a module's dotted name; a
    data file's path after its module's package), sorted."""
    files: dict[str, Path] = {}
    for name in closure(roots):
        path = locate(name)
        files[name] = path
        package, folder = _package_of(name, path), path.parent
        for data in data_files(path):
            files[f"{package}/{data.relative_to(folder).as_posix()}"] = data
    return sorted(files.items())
