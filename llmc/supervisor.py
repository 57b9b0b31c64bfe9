"""Bring crashed model instances, or a crashed server, back: what `llmc serve` runs every half second.

When a Python-backend stub process dies (killed, out of memory), Triton (the nvidia-pytriton build)
neither restarts it nor fails the requests it held: the model still reports ready, every new
request is refused with "Stub process '<instance>' is not healthy", and streams in flight get no
further response (clients end them by their own deadline). `InstanceWatch` notices the death in
the process table — the stubs are children of the server process we started, their command line
names the model's model.py — and loads the model again through the repository API (the server
runs with `--model-control-mode explicit --load-model *`), which starts fresh stubs in about a
second.

Sometimes the server itself does not survive a stub killed mid-message: its Python backend dies on
an uncaught boost::interprocess::lock_exception (SIGABRT; measured: 1 crash in 9 under load).
`Supervisor` then starts the server again on the same ports (a few restarts, then it gives up).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

STUB = "triton_python_backend_stub"
EXPLICIT_ARGS = ("--model-control-mode", "explicit", "--load-model", "*")  # every model loaded at start


@dataclass(frozen=True)
class Stub:
    pid: int
    model: str
    instance: str


def children(parent: int) -> dict[int, str]:
    """The child processes of `parent`: pid -> state letter from /proc ("Z": a zombie its parent
    has yet to reap)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):
            continue
        if int(ppid) == parent:
            found[int(entry)] = state
    return found


def stubs(server_pid: int) -> list[Stub]:
    """The live Python-backend stubs of the server process `server_pid` (a killed stub lingers as a
    zombie its parent never reaps: not live)."""
    found = []
    for pid, state in children(server_pid).items():
        if state in ("Z", "X"):
            continue
        try:
            with open(f"/proc/{pid}/cmdline") as f:
                args = f.read().split("\0")
        except OSError:
            continue
        if args and Path(args[0]).name == STUB and len(args) > 8:
            found.append(Stub(pid, Path(args[1]).parent.parent.name, args[8]))  # <repo>/<model>/<v>/model.py
    return found


class InstanceWatch:
    """Call `check()` periodically: it reloads every model one of whose stubs died, retrying at the
    next call while the reload fails (the server may be busy tearing the instance down)."""

    def __init__(self, grpc_url: str, server_pid: int, log: Callable[[str], None] = lambda message: None):
        # imported now, not at the first check: a cold import takes seconds, and a SIGTERM (llmc
        # serve's stop) landing inside it surfaced as an ImportError from numpy, not as the stop
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException

        self._grpc, self._error = grpcclient, InferenceServerException
        self.grpc_url, self.server_pid, self.log = grpc_url, server_pid, log
        self.known = {s.pid: s for s in stubs(server_pid)}
        self.pending: dict[str, int] = {}  # model -> failed reload attempts

    def check(self) -> list[str]:
        """The models reloaded by this call."""
        current = {s.pid: s for s in stubs(self.server_pid)}  # one scan: a stub dying mid-check still counts
        dead = [s for pid, s in self.known.items() if pid not in current]
        for model in sorted({s.model for s in dead}):
            which = ", ".join(f"{s.instance} (pid {s.pid})" for s in dead if s.model == model)
            self.log(f"{model}: model instance {which} crashed; its requests in flight are lost; reloading")
            self.pending.setdefault(model, 0)
        reloaded = []
        for model in sorted(self.pending):
            client = self._grpc.InferenceServerClient(self.grpc_url)
            try:
                # a load of an unchanged model (even with its own config as an override) can be a
                # no-op that keeps the dead stub; a config that differs in one parameter cannot
                config = client.get_model_config(model, as_json=True)["config"]
                config.setdefault("parameters", {})["llmc_restarted_at"] = {"string_value": str(time.time())}
                client.load_model(model, config=json.dumps(config))
            except self._error as err:
                if self.pending[model] == 0:
                    self.log(f"{model}: reload failed ({err.message()}); retrying")
                self.pending[model] += 1
                continue
            finally:
                client.close()
            del self.pending[model]
            reloaded.append(model)
            self.log(f"{model}: reloaded, serving again")
        self.known = {s.pid: s for s in stubs(self.server_pid)} if reloaded else current
        return reloaded


class Supervisor:
    """`check()`: restart the server if it exited, else reload models whose instances crashed."""

    def __init__(self, server, log: Callable[[str], None] = lambda message: None, max_restarts: int = 5):
        self.server, self.log, self.max_restarts, self.restarts = server, log, max_restarts, 0
        self.watch = InstanceWatch(server.grpc_url, server.process.pid, log)

    def check(self) -> str | None:
        """What was done: "restarted", "reloaded", or None."""
        code = self.server.process.poll()
        if code is not None:
            if self.restarts >= self.max_restarts:
                raise RuntimeError(f"tritonserver exited with {code} after {self.restarts} restarts; giving up "
                                   f"(see {self.server.log_path})")
            self.restarts += 1
            self.log(f"tritonserver exited with {code}; restarting it ({self.restarts}/{self.max_restarts}), "
                     "requests in flight are lost")
            self.server.start(timeout=300)
            self.watch = InstanceWatch(self.server.grpc_url, self.server.process.pid, self.log)
            self.log("tritonserver restarted, serving again")
            return "restarted"
        return "reloaded" if self.watch.check() else None
