"""Environment stage: the serving Python's packages packed for the container that serves the model.

Triton's Python backend takes `EXECUTION_ENV_PATH` (a config.pbtxt parameter): an archive it unpacks
and activates before starting the model's stub. This stage makes one for the Python of the Triton
container named by the spec's `execution_env` section, so a stock container (nothing installed by
hand) serves the build:

    bin/activate          what Triton's backend reads: releases up to mid-2025 source it, later ones
                          set VIRTUAL_ENV and PATH from its place and only check that it exists
    bin/python3           a link to the container's own interpreter (`execution_env.interpreter`)
    pyvenv.cfg            makes that interpreter a venv's: its stdlib, this archive's site-packages
    lib/pythonX.Y/site-packages/   the model's requirements.txt, from wheels for that Python

The choice: pip's cross-target install (`--target` with `--python-version`, `--abi` and manylinux
`--platform` tags, wheels only) laid out as a venv around the container's interpreter. venv-pack
packs an existing venv, so it needs the container's Python on the building machine; conda-pack
needs conda and packs an interpreter the container already has. pip needs neither: it fetches the
wheels made for the container's Python wherever the build runs (CI included), through the index pip
is configured with. How the stub finds the packages: its embedded interpreter, given no program
name, looks up `python3` on PATH (the archive's bin/ first), and a `pyvenv.cfg` beside it makes
sys.prefix the archive: the archive's site-packages on the container's stdlib.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from llmc.compiler.artifacts import ExecutionEnvironment, hash_outputs
from llmc.compiler.repository.package import requirements
from llmc.compiler.spec import BuildSpec, Target
from llmc.compiler.spec.sections import ExecutionEnvSpec
from llmc.compiler.stage import Context, Stage
from llmc.errors import ExecutionEnvError

ARCHIVE = "serving_env.tar.gz"
OLDEST_GLIBC = 17  # manylinux2014 (glibc 2.17): the oldest tag wheels of the requirements are made for

# the activation script Triton's backend sources (up to mid-2025; later releases only need the file to
# exist and set the same variables themselves). Written by hand: it finds its own folder, so the archive is
# relocatable wherever Triton unpacks it, which venv's and venv-pack's scripts leave to a rewrite.
ACTIVATE = """\
# Sourced by Triton's Python backend (EXECUTION_ENV_PATH) before the model's stub starts.
VIRTUAL_ENV="$(cd "$(dirname "${BASH_SOURCE[0]:-$0}")/.." && pwd)"
export VIRTUAL_ENV
PATH="$VIRTUAL_ENV/bin:$PATH"
export PATH
unset PYTHONHOME
"""


def platform_tags(section: ExecutionEnvSpec) -> list[str]:
    """The manylinux tags of wheels the container takes, newest first: every glibc from its own down to
    2.17, and the legacy manylinux2014 alias many wheels still carry (pip does not expand a given tag
    to the older ones)."""
    newest = int(section.glibc.split(".")[1])
    arch = section.arch.value
    return [f"manylinux_2_{minor}_{arch}" for minor in range(newest, OLDEST_GLIBC - 1, -1)] + [f"manylinux2014_{arch}"]


def pip_command(requirements: Path, site: Path, section: ExecutionEnvSpec) -> list[str]:
    """pip installing `requirements` into `site` for the container's Python, from wheels only (pip has
    no library API: it is run as a program)."""
    nodot = section.python.replace(".", "")
    return [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--no-input", "--no-compile",
            "--only-binary=:all:", "--target", str(site), "--python-version", section.python,
            "--implementation", "cp", "--abi", f"cp{nodot}",
            *(f"--platform={tag}" for tag in platform_tags(section)), "-r", str(requirements)]


def pack(requirements: list[str], section: ExecutionEnvSpec, out: Path, *, inputs_hash: str,
         progress=lambda done, total: None) -> ExecutionEnvironment:
    """Install `requirements` for the container's Python into a venv layout, pack it as `out/ARCHIVE` and
    record it (ExecutionEnvironment) in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="llmc-env-") as tmp:
        env = Path(tmp) / "env"
        site = env / "lib" / f"python{section.python}" / "site-packages"
        site.mkdir(parents=True)
        (Path(tmp) / "requirements.txt").write_text("\n".join(requirements) + "\n")
        progress(0, 3)
        _install(Path(tmp) / "requirements.txt", site, section, requirements)
        progress(1, 3)
        # what the model never runs: console scripts pip wrote for the building machine's Python, caches
        for path in [site / "bin", *site.rglob("__pycache__")]:
            shutil.rmtree(path, ignore_errors=True)
        packages = {d.metadata["Name"]: d.version for d in importlib.metadata.distributions(path=[str(site)])}
        _venv_around(env, section)
        progress(2, 3)
        with tarfile.open(out / ARCHIVE, "w:gz", compresslevel=6) as tar:
            for entry in sorted(env.iterdir()):
                tar.add(entry, arcname=entry.name)
        progress(3, 3)
    art = ExecutionEnvironment(inputs_hash=inputs_hash, files=hash_outputs(out, [ARCHIVE]), archive=ARCHIVE,
                               python=section.python, interpreter=section.interpreter_path,
                               platform=platform_tags(section)[0], packages=dict(sorted(packages.items())))
    art.save(out)
    return art


def _install(requirements: Path, site: Path, section: ExecutionEnvSpec, lines: list[str]) -> None:
    if importlib.util.find_spec("pip") is None:
        raise ExecutionEnvError(f"execution_env: the environment stage runs pip, and {sys.executable} has none: "
                                f"install pip into the Python that runs llmc")
    result = subprocess.run(pip_command(requirements, site, section), capture_output=True, text=True)
    if result.returncode == 0:
        return
    missing = re.findall(r"No matching distribution found for (\S+)", result.stderr)
    where = (f"CPython {section.python} on {section.arch.value} with glibc {section.glibc} "
             f"(execution_env.python, .arch, .glibc)")
    if any(name.startswith("tensorrt") for name in missing):
        raise ExecutionEnvError(
            f"execution_env: no wheel of {', '.join(missing)} for {where}: PyPI carries TensorRT's Python package "
            "as a source distribution that fetches NVIDIA's wheels when it is built, which a cross-target install "
            "cannot do. Point pip at an index holding TensorRT's wheels (PIP_EXTRA_INDEX_URL), or leave "
            "execution_env out and serve from an image with TensorRT for Python installed (llmc k8s --image)")
    if missing:
        raise ExecutionEnvError(
            f"execution_env: no wheel of {', '.join(missing)} for {where}; the serving environment needs "
            f"{', '.join(lines)}. Set execution_env.python to the Python of the Triton container that serves "
            f"the model (24.12 and later: 3.12), or raise execution_env.glibc to its glibc")
    tail = "\n".join(result.stderr.strip().splitlines()[-8:])
    raise ExecutionEnvError(f"execution_env: pip could not install the serving requirements for {where}:\n{tail}")


def _venv_around(env: Path, section: ExecutionEnvSpec) -> None:
    """bin/ and pyvenv.cfg: a venv of the container's interpreter, its site-packages this archive's."""
    interpreter = section.interpreter_path
    bin_dir = env / "bin"
    bin_dir.mkdir()
    (bin_dir / "activate").write_text(ACTIVATE)
    for name in ("python3", "python", f"python{section.python}"):
        os.symlink(interpreter, bin_dir / name)  # dangling here; the container has the interpreter
    (env / "pyvenv.cfg").write_text(f"home = {os.path.dirname(interpreter)}\n"
                                    "include-system-site-packages = false\n"
                                    f"version = {section.python}\n")


def summary(art: ExecutionEnvironment, folder: Path) -> str:
    size = (folder / art.archive).stat().st_size / 2**20
    return (f"{art.archive}: {len(art.packages)} packages for CPython {art.python} ({art.interpreter}, "
            f"{art.platform}), {size:.0f} MiB")


# the environment stage: the serving packages for the container's Python (execution_env), Triton's
# EXECUTION_ENV_PATH; it runs first, after source, and the package stage links its archive

def serving_requirements(spec: BuildSpec) -> list[str]:
    """requirements.txt's lines; a TensorRT build's engine is built by the TensorRT imported here (its
    stage's check made sure there is one), whose version the engine records and the serving Python needs."""
    if spec.target is not Target.tensorrt:
        return requirements()
    import tensorrt

    return requirements(tensorrt.__version__)


def _run(_: None, spec: BuildSpec, ctx: Context) -> ExecutionEnvironment:
    return pack(serving_requirements(spec), spec.execution_env, ctx.out, inputs_hash=ctx.inputs_hash,
                progress=ctx.progress)


ENVIRONMENT = Stage("environment", describe=lambda spec: f"packing the serving packages for CPython "
                                                         f"{spec.execution_env.python} ({spec.execution_env.interpreter_path})",
                    artifact=ExecutionEnvironment, applies=lambda spec: spec.execution_env is not None, for_package=True,
                    key=lambda spec, ctx: {"execution_env": spec.section_hash("execution_env"),
                                           "requirements": serving_requirements(spec)},
                    run=_run, summary=lambda done: summary(done.artifact, done.folder))
