"""Reliability on a real Triton server: concurrent streams with cancellations and malformed requests
mixed in (scripts/soak.py runs the same for longer, with more streams), and a model-instance crash
under load."""

import asyncio
import shutil
from pathlib import Path

import pytest

from llmc.runtime.soak import soak
from llmc.runtime.triton_server import TritonServer, assemble

SERVING_ENV = Path(__file__).resolve().parents[1] / ".venv-serving"
pytestmark = pytest.mark.triton


@pytest.fixture(scope="module")
def server(tiny_build, tmp_path_factory):
    if not (SERVING_ENV / "bin" / "python3").exists():
        pytest.skip(".venv-serving is missing: run scripts/setup.sh")
    root = tmp_path_factory.mktemp("reliability")
    shutil.copytree(tiny_build.repository, root / "repository")
    with TritonServer(root / "repository", server_dir=assemble(root / "server"), serving_env=SERVING_ENV,
                      log_path=root / "server.log") as srv:
        yield srv


def test_concurrent_streams_with_cancellations_and_malformed_requests(server):
    report = asyncio.run(soak(server.grpc_url, "tiny", streams=48, seconds=8, max_tokens=12,
                              metrics_url=f"http://127.0.0.1:{server.ports.metrics}"))
    print("\n".join(report.lines()))
    assert report.ok, "\n".join(report.lines())
    assert report.completed >= 20 and report.cancelled >= 2 and report.refused >= 2


def test_a_crashed_model_instance_fails_its_requests_and_comes_back(tiny_build, tmp_path):
    """Kill the model's stub process under load: the requests it held end with errors (by the
    client's deadline; Triton sends nothing more), the supervisor reloads the model (or restarts
    the server, when Triton's backend aborted on the dead stub's lock), new requests are served,
    and every client thread returns."""
    import os
    import signal
    import threading
    import time

    from llmc.runtime.client import Client, GenerationError
    from llmc.runtime.supervisor import EXPLICIT_ARGS, Supervisor

    if not (SERVING_ENV / "bin" / "python3").exists():
        pytest.skip(".venv-serving is missing: run scripts/setup.sh")
    shutil.copytree(tiny_build.repository, tmp_path / "repository")
    with TritonServer(tmp_path / "repository", server_dir=assemble(tmp_path / "server"), serving_env=SERVING_ENV,
                      log_path=tmp_path / "server.log", extra_args=EXPLICIT_ARGS) as srv:
        messages: list[str] = []
        supervisor = Supervisor(srv, log=messages.append)
        (victim,) = supervisor.watch.known.values()
        ok, errors, stop = [], [], threading.Event()

        def work():
            client = Client(srv.grpc_url, "tiny", timeout=8)
            while not stop.is_set():
                try:
                    client.complete("under load", max_tokens=60, min_tokens=60)
                    ok.append(time.monotonic())
                except GenerationError as err:
                    errors.append(str(err))

        threads = [threading.Thread(target=work) for _ in range(3)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        os.kill(victim.pid, signal.SIGKILL)  # the stub of the server this test started
        killed = time.monotonic()
        deadline = killed + 20
        while not supervisor.check() and time.monotonic() < deadline:  # "reloaded" (or, when Triton's
            time.sleep(0.2)                                                # backend aborted, "restarted")
        assert any("serving again" in m for m in messages), messages
        while not [t for t in ok if t > killed + 1] and time.monotonic() < deadline + 20:
            supervisor.check()  # the backend may still abort while it tears the dead instance down
            time.sleep(0.2)
        stop.set()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads)  # nothing hangs
        assert errors, "the requests the dead instance held must end with an error"
        assert [t for t in ok if t > killed + 1], "the reloaded model serves again"
        assert supervisor.watch.known and victim.pid not in supervisor.watch.known
        assert Client(srv.grpc_url, "tiny").complete("after", max_tokens=4).finish_reason == "length"
