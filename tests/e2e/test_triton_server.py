"""A real Triton server from the nvidia-pytriton wheel: assembled, started on free ports, stopped clean."""

from pathlib import Path

import numpy as np
import pytest

from serving_rig import SERVING_ENV, serving_env, shm, stub_shm_regions
from llmc.triton_server import Ports, TritonError, TritonServer, assemble

pytestmark = pytest.mark.triton

ECHO_CONFIG = """name: "echo"
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
"""
ECHO_MODEL = """import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", (pb_utils.get_input_tensor_by_name(r, "IN").as_numpy() * 2).astype(np.float32))]) for r in requests]
"""


@pytest.fixture(scope="module")
def server_dir(tmp_path_factory):
    serving_env()  # skips without .venv-serving
    return assemble(tmp_path_factory.mktemp("triton") / "server")


def _echo_repository(root: Path) -> Path:
    (root / "echo" / "1").mkdir(parents=True)
    (root / "echo" / "config.pbtxt").write_text(ECHO_CONFIG)
    (root / "echo" / "1" / "model.py").write_text(ECHO_MODEL)
    return root


def test_python_backend_model_serves_and_the_server_stops_clean(server_dir, tmp_path):
    import tritonclient.http as http

    server = TritonServer(_echo_repository(tmp_path / "repo"), server_dir=server_dir, serving_env=SERVING_ENV,
                          log_path=tmp_path / "server.log")
    with server:
        client = http.InferenceServerClient(server.http_url)
        assert client.is_server_ready() and client.is_model_ready("echo")
        regions = stub_shm_regions(server.process.pid)
        assert regions and regions <= shm()  # the stub's, as /dev/shm names them
        inp = http.InferInput("IN", [3], "FP32")
        inp.set_data_from_numpy(np.array([1, 2, 3], dtype=np.float32))
        out = client.infer("echo", [inp]).as_numpy("OUT")
        np.testing.assert_array_equal(out, [2, 4, 6])  # numpy<2 in the stub's environment: outputs intact
        client.close()
        pid = server.process.pid
    assert server.process.returncode is not None and not Path(f"/proc/{pid}").exists()
    assert regions & shm() == set()  # the Python backend's shared-memory regions are gone


def test_a_broken_repository_fails_start_with_the_log_named(server_dir, tmp_path):
    (tmp_path / "repo" / "bad" / "1").mkdir(parents=True)
    (tmp_path / "repo" / "bad" / "config.pbtxt").write_text('backend: "no-such-backend"\n')
    server = TritonServer(tmp_path / "repo", server_dir=server_dir, serving_env=SERVING_ENV,
                          log_path=tmp_path / "server.log", ports=Ports.free())
    with pytest.raises(TritonError, match="server.log"):
        server.start(timeout=60)
    assert server.process.poll() is not None
