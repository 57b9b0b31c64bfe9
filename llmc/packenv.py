"""`llmc pack-env`: the serving environment packed into the repository, so the Triton that loads the
model needs nothing installed by hand.

Triton's Python backend takes `EXECUTION_ENV_PATH` (a config.pbtxt parameter): an archive of a Python
environment it unpacks and activates before starting the model's stub. `pack_env` packs the serving
venv (by default `.venv-serving`, which holds exactly the model's requirements.txt) with venv-pack
into `<name>/1/serving_env.tar.gz` and points the build's config at it through
`$$TRITON_MODEL_DIRECTORY`, which Triton resolves to its local copy of the model (also when the
repository is in a bucket). `llmc deploy` uploads it with the version and points the served config
at the version's own archive.

The choice: venv-pack, because the serving environment here is a venv. A venv's archive holds the
packages, not the interpreter: its `bin/python3` links to the Python that made it, so the archive
works where that Python exists at the same path (the same base image; Triton's stub must also match
its version). For a stock Triton container (its own Python 3.10) pack a conda environment of that
Python with conda-pack instead; the config parameter is the same. Run it again after each
`llmc build`: the package stage writes a fresh repository.
"""

from __future__ import annotations

import importlib.metadata
import time
from dataclasses import dataclass
from pathlib import Path

from llmc.deploy import ENV_PARAMETER, built_model

ARCHIVE = "serving_env.tar.gz"
# what the model never imports: installers and bytecode caches (Python rebuilds those)
EXCLUDES = ("*__pycache__*", "*/site-packages/pip/*", "*/site-packages/pip-*", "*/site-packages/setuptools/*",
            "*/site-packages/setuptools-*", "*/site-packages/_distutils_hack/*", "*/distutils-precedence.pth",
            "bin/Activate.ps1")


class PackError(RuntimeError):
    """The environment cannot serve the model, or cannot be packed."""


@dataclass(frozen=True)
class PackResult:
    archive: Path
    bytes: int
    seconds: float


def missing_requirements(env: Path, requirements: list[str]) -> list[str]:
    """The requirement lines `env`'s site-packages does not satisfy."""
    from packaging.requirements import Requirement

    site = sorted(Path(env).glob("lib/python3*/site-packages"))
    installed = {d.metadata["Name"].lower().replace("_", "-"): d.version
                 for d in importlib.metadata.distributions(path=[str(s) for s in site])}
    missing = []
    for line in requirements:
        req = Requirement(line)
        version = installed.get(req.name.lower().replace("_", "-"))
        if version is None or not req.specifier.contains(version, prereleases=True):
            missing.append(f"{line} (found {version or 'nothing'})")
    return missing


def pack_env(build_dir: Path, serving_env: Path | None = None, model: str | None = None) -> PackResult:
    """Pack the serving environment into the build's version folder and point its config at it."""
    import venv_pack

    from llmc.compiler.triton_config import parse, render
    from llmc.triton_server import find_serving_env

    start = time.monotonic()
    built = built_model(Path(build_dir), model)
    env = find_serving_env(serving_env)
    requirements = [r for r in (built / "requirements.txt").read_text().splitlines() if r.strip()]
    missing = missing_requirements(env, requirements)
    if missing:
        raise PackError(f"{env}: does not satisfy {built / 'requirements.txt'}: {'; '.join(missing)}")
    archive = built / "1" / ARCHIVE
    try:
        venv_pack.pack(prefix=str(env), output=str(archive), force=True,
                       filters=[("exclude", pattern) for pattern in EXCLUDES])
    except venv_pack.VenvPackException as err:
        raise PackError(f"{env}: venv-pack failed: {err}") from None
    cfg = parse((built / "config.pbtxt").read_text())
    cfg.parameters[ENV_PARAMETER].string_value = f"$$TRITON_MODEL_DIRECTORY/1/{ARCHIVE}"
    (built / "config.pbtxt").write_text(render(cfg))
    return PackResult(archive, archive.stat().st_size, time.monotonic() - start)
