"""Reliability on a real Triton server: concurrent streams with cancellations and malformed requests
mixed in (scripts/soak.py runs the same for longer, with more streams), and a model-instance crash
under load."""

import asyncio
import shutil

import pytest

from serving_rig import BackgroundLoad, serving_env
from llmc.soak import soak
from llmc.triton_server import TritonServer, assemble

pytestmark = pytest.mark.triton


@pytest.fixture(scope="module")
def server(tiny_build, tmp_path_factory):
    env = serving_env()
    root = tmp_path_factory.mktemp("reliability")
    shutil.copytree(tiny_build.repository, root / "repository")
    with TritonServer(root / "repository", server_dir=assemble(root / "server"), serving_env=env,
                      log_path=root / "server.log") as srv:
        yield srv


def test_concurrent_streams_with_cancellations_and_malformed_requests(server):
    report = asyncio.run(soak(server.grpc_url, "tiny", streams=48, seconds=8, max_tokens=12,
                              metrics_url=f"http://127.0.0.1:{server.ports.metrics}"))
    print("\n".join(report.lines()))
    assert report.ok, "\n".join(report.lines())
    assert report.completed >= 20 and report.cancelled >= 2 and report.refused >= 2


def _supervised(tiny_build, tmp_path):
    from llmc.supervisor import EXPLICIT_ARGS

    env = serving_env()
    shutil.copytree(tiny_build.repository, tmp_path / "repository")
    return TritonServer(tmp_path / "repository", server_dir=assemble(tmp_path / "server"), serving_env=env,
                        log_path=tmp_path / "server.log", extra_args=EXPLICIT_ARGS)


def test_a_crashed_model_instance_fails_its_requests_and_comes_back(tiny_build, tmp_path):
    """Kill the model's stub process under load: the requests it held end with errors (by the
    client's deadline; Triton sends nothing more), the supervisor reloads the model (or restarts
    the server, when Triton's backend aborted on the dead stub's lock), new requests are served,
    and every client thread returns."""
    import os
    import signal
    import time

    from llmc.client import Client
    from llmc.supervisor import Supervisor

    with _supervised(tiny_build, tmp_path) as srv:
        messages: list[str] = []
        supervisor = Supervisor(srv, log=messages.append)
        (victim,) = supervisor.watch.known.values()
        with BackgroundLoad(srv.grpc_url, max_tokens=60, timeout=8) as load:
            time.sleep(1.0)
            os.kill(victim.pid, signal.SIGKILL)  # the stub of the server this test started
            killed = time.monotonic()
            while not supervisor.check() and time.monotonic() < killed + 20:  # "reloaded", or "restarted"
                time.sleep(0.2)                                                # when Triton's backend aborted
            assert any("serving again" in m for m in messages), messages
            while not load.served_after(killed + 1) and time.monotonic() < killed + 40:
                supervisor.check()  # the backend may still abort while it tears the dead instance down
                time.sleep(0.2)
        assert load.errors, "the requests the dead instance held must end with an error"
        assert load.served_after(killed + 1), ("the reloaded model serves again", messages, load.errors[-3:])
        assert supervisor.watch.known and victim.pid not in supervisor.watch.known
        assert Client(srv.grpc_url, "tiny").complete("after", max_tokens=4).finish_reason == "length"


def test_a_crashed_server_is_restarted_and_clients_recover(tiny_build, tmp_path):
    import os
    import signal
    import time

    from llmc.supervisor import Supervisor

    with _supervised(tiny_build, tmp_path) as srv:
        messages: list[str] = []
        supervisor = Supervisor(srv, log=messages.append)
        with BackgroundLoad(srv.grpc_url, max_tokens=60, timeout=8) as load:
            time.sleep(1.0)
            crashed = srv.process.pid
            os.kill(crashed, signal.SIGKILL)  # the server this test started
            killed = time.monotonic()
            while not load.served_after(killed + 0.5) and time.monotonic() < killed + 40:
                supervisor.check()
                time.sleep(0.2)
        assert any(m.startswith("tritonserver exited with -9; restarting it (1/5)") for m in messages), messages
        assert load.errors and load.served_after(killed + 0.5), (messages, load.errors[-3:])
        assert _group_members(crashed) == {}  # the crashed server's stubs were killed with the restart


def _group_members(pgid: int, wait: float = 10.0) -> dict[int, str]:
    """The live processes of process group `pgid` (pid -> command), once they are gone or `wait` is
    up: a process killed a moment ago lingers until it is reaped (state Z), which is not live."""
    import os
    import time

    deadline = time.monotonic() + wait
    while True:
        live = {}
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                with open(f"/proc/{entry}/cmdline") as f:
                    command = f.read().replace("\0", " ")[:120]
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                live[int(entry)] = command
        if not live or time.monotonic() > deadline:
            return live
        time.sleep(0.2)
