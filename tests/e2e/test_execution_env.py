"""The environment stage (execution_env): the serving packages fetched as wheels for a container's
Python, laid out as a venv around that container's interpreter and packed into the repository as
Triton's EXECUTION_ENV_PATH. pip reaches the package index here as in CI (PyPI)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile

import pytest

from checkpoints import TINY_SERVING_SPEC
from llmc.client import Client
from llmc.compiler import build
from llmc.compiler.repository import environment
from llmc.compiler.repository.package import requirements
from llmc.compiler.spec import ExecutionEnvSpec, parse_spec
from llmc.compiler.repository.triton_config import model_config, parse, render
from llmc.errors import ExecutionEnvError, SpecError
from llmc.runtime.manifest import RepositoryManifest
from llmc.triton_server import TritonServer, assemble

PYTHON = sysconfig.get_python_version()
# the interpreter this test's "container" runs: this machine's own, by its real path (not the .venv's link)
INTERPRETER = os.path.realpath(sys._base_executable)


def _spec(checkpoint, **env):
    return parse_spec({"name": "tiny", "source": str(checkpoint), **TINY_SERVING_SPEC, "execution_env": env})


def _members(archive) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(archive) as tar:
        return {m.name: m for m in tar.getmembers()}


@pytest.fixture(scope="module")
def packed(tiny_build, tiny_checkpoints, tmp_path_factory):
    """The tiny build again with execution_env for this machine's Python, and that build's result."""
    output = tmp_path_factory.mktemp("packed") / "tiny"
    shutil.copytree(tiny_build.output, output)  # the model's stages come from the cache: only the new ones run
    return build(_spec(tiny_checkpoints["llama"], python=PYTHON, interpreter=INTERPRETER), output=output)


def _bare_python(folder):
    """A venv without a package: the Python a stock container's Triton starts with."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    assert subprocess.run([str(folder / "bin" / "python3"), "-c", "import numpy"], capture_output=True).returncode != 0
    return folder


@pytest.mark.triton
def test_the_build_packs_the_serving_packages_and_a_bare_python_serves_them(packed, tiny_checkpoints, tmp_path):
    status = {s.name: s.status for s in packed.stages}
    assert status["export"] == "cached" and status["environment"] == "ran"
    env = packed.artifacts["environment"].artifact
    installed = {name.lower(): version for name, version in env.packages.items()}
    for line in requirements():  # what requirements.txt asks, as installed for the container's Python
        name, _, pin = line.partition("==")
        assert name.split("<")[0].split(">")[0] in installed and (not pin or installed[name] == pin), line

    model = packed.output / "model_repository" / "tiny"
    archive = model / "1" / environment.ARCHIVE
    members = _members(archive)
    site = f"lib/python{PYTHON}/site-packages"
    assert members["bin/python3"].issym() and members["bin/python3"].linkname == INTERPRETER
    assert {"bin/activate", "pyvenv.cfg", f"{site}/numpy/__init__.py", f"{site}/onnxruntime/__init__.py",
            f"{site}/tokenizers/__init__.py"} <= set(members)
    assert not any(n.startswith(f"{site}/bin/") or "__pycache__" in n or n.startswith(f"{site}/pip/")
                   for n in members)  # no console scripts for the building machine's Python, no caches
    config = parse((model / "config.pbtxt").read_text())
    assert config.parameters["EXECUTION_ENV_PATH"].string_value == f"$$TRITON_MODEL_DIRECTORY/1/{environment.ARCHIVE}"
    manifest = RepositoryManifest.load(model / "1")
    assert (manifest.execution_env.python, manifest.execution_env.interpreter) == (PYTHON, INTERPRETER)

    bare = _bare_python(tmp_path / "bare")
    with TritonServer(model.parent, server_dir=assemble(tmp_path / "server"), serving_env=bare,
                      log_path=tmp_path / "server.log") as server:
        assert len(Client(server.grpc_url, "tiny").complete("packed", max_tokens=4).output_ids) == 4
    log = (tmp_path / "server.log").read_text()
    assert f"Using Python execution env {archive}" in log and "Error processing line" not in log

    again = build(_spec(tiny_checkpoints["llama"], python=PYTHON, interpreter=INTERPRETER), output=packed.output)
    assert {s.name: s.status for s in again.stages}["environment"] == "cached"


@pytest.mark.triton
def test_a_replica_with_a_bare_python_serves_the_packed_build_from_a_bucket(packed, tmp_path):
    """Deployed twice (the second prunes the first): the replica copies version 2 from the bucket and
    runs it in version 2's own archive."""
    from llmc.fleet.deploy import deploy
    from s3_server import bucket_server

    with bucket_server() as s3:
        url = f"s3://{s3.endpoint}/models/repo"
        deploy(packed.output, url, [])
        deploy(packed.output, url, [], keep=1)
        assert sorted({key.split("/")[2] for key in s3.keys("models", "repo/tiny/") if key.count("/") > 2}) == ["2"]
        with TritonServer(url, server_dir=assemble(tmp_path / "server"), serving_env=_bare_python(tmp_path / "bare"),
                          log_path=tmp_path / "server.log") as server:
            assert len(Client(server.grpc_url, "tiny").complete("from the bucket", max_tokens=4).output_ids) == 4
    log = (tmp_path / "server.log").read_text()
    assert re.search(rf"Using Python execution env \S+/2/{re.escape(environment.ARCHIVE)}", log), log[-2000:]


def test_the_archive_is_made_for_the_containers_python_not_the_builders(tmp_path):
    other = "3.12" if PYTHON != "3.12" else "3.11"
    section = ExecutionEnvSpec(python=other)
    art = environment.pack(requirements(), section, tmp_path, inputs_hash="h")
    assert (art.python, art.interpreter, art.platform) == (other, f"/usr/bin/python{other}", "manylinux_2_35_x86_64")
    members = _members(tmp_path / environment.ARCHIVE)
    tag = f"cpython-{other.replace('.', '')}-x86_64-linux-gnu.so"
    site = f"lib/python{other}/site-packages"
    assert any(n.startswith(f"{site}/numpy/") and n.endswith(tag) for n in members)  # wheels built for that Python
    assert not any(f"cpython-{PYTHON.replace('.', '')}-" in n for n in members)
    assert members["bin/python3"].linkname == f"/usr/bin/python{other}"
    with tarfile.open(tmp_path / environment.ARCHIVE) as tar:
        cfg = tar.extractfile("pyvenv.cfg").read().decode()
        activate = tar.extractfile("bin/activate").read().decode()
    assert cfg.splitlines() == ["home = /usr/bin", "include-system-site-packages = false", f"version = {other}"]
    assert 'PATH="$VIRTUAL_ENV/bin:$PATH"' in activate


def test_a_python_without_the_wheels_fails_the_build_naming_the_field(tiny_build, tiny_checkpoints, tmp_path):
    output = tmp_path / "tiny"
    shutil.copytree(tiny_build.output, output)
    before = sorted(p.relative_to(output) for p in output.rglob("*"))
    refused = (r"execution_env: no wheel of onnxruntime==\S+ for CPython 3\.10 on x86_64 with glibc 2\.35 "
               r"\(execution_env\.python.*24\.12 and later: 3\.12")
    with pytest.raises(ExecutionEnvError, match=refused):
        build(_spec(tiny_checkpoints["llama"], python="3.10"), output=output)
    exported = build(_spec(tiny_checkpoints["llama"], python="3.10"), output=tmp_path / "export", until="export")
    assert [s.name for s in exported.stages] == ["source", "export"]  # packed only for the repository
    assert sorted(p.relative_to(output) for p in output.rglob("*")) == before  # the last build stands, untouched


def test_a_tensorrt_build_is_told_where_its_wheels_are(tmp_path):
    with pytest.raises(ExecutionEnvError, match=r"no wheel of tensorrt==10\.14\.1\.48 for CPython 3\.12 .*source "
                                                r"distribution.*PIP_EXTRA_INDEX_URL.*llmc k8s --image"):
        environment.pack(requirements("10.14.1.48"), ExecutionEnvSpec(), tmp_path, inputs_hash="h")
    assert not (tmp_path / environment.ARCHIVE).exists()


@pytest.mark.parametrize("field, value, message", [
    ("python", "3", r"execution_env\.python: give the container's Python as major\.minor"),
    ("python", 3.12, r"execution_env\.python: Input should be a valid string"),
    ("glibc", "2.5", r"execution_env\.glibc: give the container's glibc as 2\.N with N >= 17"),
    ("interpreter", "python3", r"execution_env\.interpreter: the interpreter's absolute path in the container"),
    ("arch", "arm64", r"execution_env\.arch: Input should be 'x86_64' or 'aarch64'"),
    ("pyhton", "3.12", r"execution_env\.pyhton: unknown field"),
])
def test_the_section_names_the_field_at_fault(field, value, message):
    with pytest.raises(SpecError, match=message):
        parse_spec({"name": "m", "source": "ckpt", "execution_env": {field: value}})


def test_wheels_of_every_older_glibc_are_taken():
    tags = environment.platform_tags(ExecutionEnvSpec(glibc="2.39", arch="aarch64"))
    assert tags[0] == "manylinux_2_39_aarch64" and tags[-2:] == ["manylinux_2_17_aarch64", "manylinux2014_aarch64"]
    assert len(tags) == 39 - 17 + 2
    command = environment.pip_command("r.txt", "site", ExecutionEnvSpec())
    assert command[command.index("--abi") + 1] == "cp312" and "--only-binary=:all:" in command


def test_the_plan_lists_the_stage(tiny_checkpoints):
    from llmc.compiler import plan_build

    plan = plan_build(_spec(tiny_checkpoints["llama"]))
    assert plan.stages[:3] == ["source", "environment", "export"]  # first: a Python without wheels fails early
    assert any("wheels for CPython 3.12" in note and "/usr/bin/python3.12" in note for note in plan.notes)


def test_a_deployed_version_points_at_its_own_archive():
    from llmc.fleet.deploy import pinned

    text = render(model_config("tiny", execution_env=f"1/{environment.ARCHIVE}"))
    served = parse(pinned(text, 7))
    assert list(served.version_policy.specific.versions) == [7]
    assert served.parameters["EXECUTION_ENV_PATH"].string_value == f"$$TRITON_MODEL_DIRECTORY/7/{environment.ARCHIVE}"
    assert list(parse(pinned(pinned(text, 7), 8)).version_policy.specific.versions) == [8]
