"""Check the import rules (the contracts in pyproject.toml's [tool.importlinter]) with import-linter.

    .venv/bin/python scripts/lint_imports.py [--root DIR] [lint-imports options, e.g. --verbose]

The source folders are not laid out as the package they install as: `llmc.compiler` lives in
compiler/, `llmc.runtime` in runtime/ and so on ([tool.setuptools] package-dir), while import-linter
finds a package's modules by walking the one folder the package is imported from. So the check runs
on a view: a temporary folder holding `llmc/` as installed, made of links to the source folders
(nothing is copied or written in the tree), from which `lint-imports` runs with the tree's
pyproject.toml. The exit status is lint-imports' own: 0 when every contract is kept.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10: import-linter depends on tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def make_view(root: Path, dest: Path) -> None:
    """`dest/<package path>` for every package in `root`'s package-dir mapping: a link to its source
    folder, or, for a package with mapped subpackages (the `llmc` root), a folder of links to its
    entries with the subpackages linked in beside them."""
    mapping = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for package in sorted(mapping, key=lambda name: name.count(".")):  # parents before their subpackages
        target, source = dest.joinpath(*package.split(".")), root / mapping[package]
        if any(other.startswith(package + ".") for other in mapping):
            target.mkdir(parents=True)
            for entry in source.iterdir():
                if entry.name != "__pycache__":
                    (target / entry.name).symlink_to(entry)
        else:
            target.symlink_to(source, target_is_directory=True)


def lint(root: Path, options: list[str]) -> subprocess.CompletedProcess:
    """Run lint-imports on `root`'s tree and contracts; its report is in the result's stdout."""
    lint_imports = Path(sys.executable).with_name("lint-imports")
    with tempfile.TemporaryDirectory(prefix="llmc-lint-imports-") as view:
        make_view(root, Path(view))
        # lint-imports puts its working directory first on the Python path: `llmc` is imported from the view
        return subprocess.run([str(lint_imports), "--no-cache", "--no-logo", *options, str(root / "pyproject.toml")],
                              cwd=view, capture_output=True, text=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="the source tree to check (default: this one)")
    args, options = parser.parse_known_args()
    result = lint(args.root.resolve(), options)
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
