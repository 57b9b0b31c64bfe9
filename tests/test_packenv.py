"""`llmc pack-env`: the serving environment packed into the repository (Triton's EXECUTION_ENV_PATH)
serves the model on a Triton whose own Python has none of the model's packages."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from conftest import serving_env
from llmc.client import Client
from llmc.compiler.triton_config import parse
from llmc.packenv import ARCHIVE, PackError, missing_requirements, pack_env
from llmc.triton_server import TritonServer, assemble


@pytest.mark.triton
def test_the_packed_environment_serves_on_a_bare_python(tiny_build, tmp_path):
    env = serving_env()
    build = tmp_path / "tiny"
    shutil.copytree(tiny_build.output, build)
    result = pack_env(build, env)
    model = build / "model_repository" / "tiny"
    assert result.archive == model / "1" / ARCHIVE and result.bytes > 10 * 2**20
    config = parse((model / "config.pbtxt").read_text())
    assert config.parameters["EXECUTION_ENV_PATH"].string_value == f"$$TRITON_MODEL_DIRECTORY/1/{ARCHIVE}"

    bare = tmp_path / "bare"  # the Python Triton starts with: no numpy, onnxruntime, tokenizers, pydantic
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    assert subprocess.run([str(bare / "bin" / "python3"), "-c", "import numpy"], capture_output=True).returncode != 0
    with TritonServer(model.parent, server_dir=assemble(tmp_path / "server"), serving_env=bare,
                      log_path=tmp_path / "server.log") as server:
        assert len(Client(server.grpc_url, "tiny").complete("packed", max_tokens=4).output_ids) == 4
    log = (tmp_path / "server.log").read_text()
    assert f"Using Python execution env {result.archive}" in log and "Error processing line" not in log


def test_an_environment_missing_a_requirement_is_refused(tiny_build, tmp_path):
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    assert missing_requirements(bare, ["numpy<2"]) == ["numpy<2 (found nothing)"]
    with pytest.raises(PackError, match=r"bare: does not satisfy .*requirements.txt: numpy<2 \(found nothing\)"):
        pack_env(tiny_build.output, bare)
    assert not (tiny_build.repository / "tiny" / "1" / ARCHIVE).exists()


def test_a_deployed_version_points_at_its_own_archive(tiny_build):
    from llmc.deploy import pinned

    cfg = parse((tiny_build.repository / "tiny" / "config.pbtxt").read_text())
    cfg.parameters["EXECUTION_ENV_PATH"].string_value = f"$$TRITON_MODEL_DIRECTORY/1/{ARCHIVE}"
    from llmc.compiler.triton_config import render

    served = parse(pinned(render(cfg), 7))
    assert list(served.version_policy.specific.versions) == [7]
    assert served.parameters["EXECUTION_ENV_PATH"].string_value == f"$$TRITON_MODEL_DIRECTORY/7/{ARCHIVE}"
    assert list(parse(pinned(pinned(render(cfg), 7), 8)).version_policy.specific.versions) == [8]
