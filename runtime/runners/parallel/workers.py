"""Worker processes for the ranks of a split model: a fresh interpreter per rank, talking to the process that
started it over a socket pair (a `multiprocessing.connection.Connection` at each end).

    start_worker("pkg.module", "function", job, cwd=..., env={...})   -> (Popen, Connection)
        runs `pkg.module.function(connection)` in a new `python -c`, with this process's import path, `job` its
        first message
    die_with_parent()   in the worker: end it when the process that started it ends
    serve_calls(conn, runner, rank, abort)   in the worker: run the leader's calls on the rank's runner
    stop_workers(workers, conns)   in the leader: tell them to close, wait, kill one that is stuck

Used by the served model's ranks (ort_group.py, trt_group.py) and the build's quantization of a split model
(compiler/quantize/ranks.py). Not multiprocessing's spawn, which re-runs the caller's main script (inside Triton's
Python backend, the stub), and whose children inherit only this process's environment.
"""

from __future__ import annotations

import multiprocessing.connection
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

__all__ = ["die_with_parent", "python_executable", "serve_calls", "start_worker", "stop_workers"]

PARENT_CHECK_S = 0.2  # how soon a worker whose parent ended notices


def python_executable() -> str:
    """The interpreter a worker runs on: this one. Inside Triton's Python backend `sys.executable` is the backend's
    stub, not a Python, so the environment's own `bin/python3` is taken there."""
    if Path(sys.executable).name.startswith("python"):
        return sys.executable
    return str(Path(sys.exec_prefix) / "bin" / "python3")


def start_worker(module: str, function: str, job: Any, *, cwd: Path, env: Mapping[str, str] | None = None
                 ) -> tuple[subprocess.Popen, multiprocessing.connection.Connection]:
    """A worker process running `module.function(conn)`, told `job` first (its first `conn.recv()`), and this end of
    the socket pair `conn` is the other end of. A worker that dies at once is not an error here: the caller's next
    read of `conn` meets its end, and the process its exit code. `cwd`: where it runs; `-c` puts the working
    directory first on the import path, and the caller's may hold another `llmc` (a checkout) that would shadow the
    one this process runs, so give a folder of data (a graph's). `env`: added to this process's environment."""
    ours, theirs = socket.socketpair()
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), **(env or {})}
    command = [python_executable(), "-c", "import sys, multiprocessing.connection as c; "
                                          f"from {module} import {function} as main; "
                                          "main(c.Connection(int(sys.argv[1])))", str(theirs.fileno())]
    try:
        process = subprocess.Popen(command, pass_fds=[theirs.fileno()], env=environment, stdin=subprocess.DEVNULL,
                                   cwd=cwd)
    finally:
        theirs.close()
    conn = multiprocessing.connection.Connection(ours.detach())
    try:
        conn.send(job)
    except OSError:  # it died at once: the caller's next read reports it
        pass
    return process, conn


def die_with_parent() -> None:
    """End this worker when the process that started it has ended, however it ended: a worker blocked in a
    collective would otherwise wait for the collective's timeout. A thread watching the parent id (the collective
    runs without the GIL), not Linux's PR_SET_PDEATHSIG, which fires when the starting *thread* ends, and the
    serving loop starts a new runner from its engine thread."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_CHECK_S)
        os._exit(1)

    threading.Thread(target=watch, name="llmc-rank-parent-watch", daemon=True).start()


def serve_calls(conn: multiprocessing.connection.Connection, runner: Any, rank: int,
                abort: Callable[[str], None]) -> None:
    """A rank worker's loop: run each `(method, args)` the leader sends on `runner` until it says close (or goes),
    answering nothing, since the ranks' collectives keep them in step. A call that fails calls `abort(reason)`
    (which ends the other ranks' waits in their collectives), sends the reason back, and ends the loop."""
    while True:
        try:
            method, args = conn.recv()
        except (EOFError, OSError):  # the leader is gone
            return
        if method == "close":
            return
        try:
            getattr(runner, method)(*args)
        except BaseException as err:  # noqa: BLE001 (everything goes back to the leader)
            reason = f"rank {rank} failed in {method}: {type(err).__name__}: {err}"
            abort(reason)
            conn.send(("error", reason))
            return


def stop_workers(workers: Sequence[subprocess.Popen], conns: Sequence[multiprocessing.connection.Connection],
                 timeout_s: float = 10.0) -> None:
    """Tell each worker to close, wait for it (killing one still there after `timeout_s`: stuck in a collective whose
    peer is gone), and close the sockets."""
    for conn in conns:
        try:
            conn.send(("close", ()))
        except (OSError, ValueError):
            pass
    for worker in workers:
        try:
            worker.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
    for conn in conns:
        conn.close()
