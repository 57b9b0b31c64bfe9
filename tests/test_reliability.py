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


class _Load:
    """Three threads sending 60-token requests (client deadline 8 s) until stopped."""

    def __init__(self, url: str):
        import threading

        self.url, self.ok, self.errors, self.stop = url, [], [], threading.Event()
        self.threads = [threading.Thread(target=self._work) for _ in range(3)]

    def _work(self):
        import time

        from llmc.runtime.client import Client, GenerationError

        client = Client(self.url, "tiny", timeout=8)
        while not self.stop.is_set():
            try:
                client.complete("under load", max_tokens=60, min_tokens=60)
                self.ok.append(time.monotonic())
            except GenerationError as err:
                self.errors.append(str(err))
                time.sleep(0.05)

    def served_after(self, moment: float) -> bool:
        return any(t > moment for t in self.ok)

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(30)
        assert not any(t.is_alive() for t in self.threads)  # nothing hangs


def _supervised(tiny_build, tmp_path):
    from llmc.runtime.supervisor import EXPLICIT_ARGS

    if not (SERVING_ENV / "bin" / "python3").exists():
        pytest.skip(".venv-serving is missing: run scripts/setup.sh")
    shutil.copytree(tiny_build.repository, tmp_path / "repository")
    return TritonServer(tmp_path / "repository", server_dir=assemble(tmp_path / "server"), serving_env=SERVING_ENV,
                        log_path=tmp_path / "server.log", extra_args=EXPLICIT_ARGS)


def test_a_crashed_model_instance_fails_its_requests_and_comes_back(tiny_build, tmp_path):
    """Kill the model's stub process under load: the requests it held end with errors (by the
    client's deadline; Triton sends nothing more), the supervisor reloads the model (or restarts
    the server, when Triton's backend aborted on the dead stub's lock), new requests are served,
    and every client thread returns."""
    import os
    import signal
    import time

    from llmc.runtime.client import Client
    from llmc.runtime.supervisor import Supervisor

    with _supervised(tiny_build, tmp_path) as srv:
        messages: list[str] = []
        supervisor = Supervisor(srv, log=messages.append)
        (victim,) = supervisor.watch.known.values()
        with _Load(srv.grpc_url) as load:
            time.sleep(1.0)
            os.kill(victim.pid, signal.SIGKILL)  # the stub of the server this test started
            killed = time.monotonic()
            while not supervisor.check() and time.monotonic() < killed + 20:  # "reloaded", or "restarted"
                time.sleep(0.2)                                                # when Triton's backend aborted
            assert any("serving again" in m for m in messages), messages
            while not load.served_after(killed + 1) and time.monotonic() < killed + 40:
                supervisor.check()  # the backend may still abort while it tears the dead instance down
                time.sleep(0.2)
        Path("/tmp/crash_debug.txt").write_text("\n".join(messages + load.errors[-3:] + [l for l in (tmp_path / "server.log").read_text().splitlines() if "tiny" in l or "stub" in l.lower() or "E1123" in l]))
        assert load.errors, "the requests the dead instance held must end with an error"
        assert load.served_after(killed + 1), ("the reloaded model serves again", messages, load.errors[-3:])
        assert supervisor.watch.known and victim.pid not in supervisor.watch.known
        assert Client(srv.grpc_url, "tiny").complete("after", max_tokens=4).finish_reason == "length"


def test_a_crashed_server_is_restarted_and_clients_recover(tiny_build, tmp_path):
    import os
    import signal
    import time

    from llmc.runtime.supervisor import Supervisor

    with _supervised(tiny_build, tmp_path) as srv:
        messages: list[str] = []
        supervisor = Supervisor(srv, log=messages.append)
        with _Load(srv.grpc_url) as load:
            time.sleep(1.0)
            os.kill(srv.process.pid, signal.SIGKILL)  # the server this test started
            killed = time.monotonic()
            while not load.served_after(killed + 0.5) and time.monotonic() < killed + 40:
                supervisor.check()
                time.sleep(0.2)
        assert any(m.startswith("tritonserver exited with -9; restarting it (1/5)") for m in messages), messages
        assert load.errors and load.served_after(killed + 0.5), (messages, load.errors[-3:])
