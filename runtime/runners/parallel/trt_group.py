"""Run a slot engine split over N GPUs (tensor parallelism on TensorRT): rank 0's engine in this process on GPU 0,
ranks 1 .. N-1 in worker processes on GPUs 1 .. N-1 (the order CUDA_VISIBLE_DEVICES gives), stepping in lockstep.

`TrtTensorParallelRunner` is a drop-in for `TrtRunner` (runtime/runners/trt.py): the same `step(input_ids,
cache_position, first_row, sequence_lengths)`, `close`, `rows`, `capacity`, `layout`. Each rank is a
`TrtRankRunner` (trt_rank.py) on its own engine (`rank{r}/model.plan`: its heads, its slices of the
projections, its KV heads) with its own KV cache. Rank 0 makes the NCCL unique id; each worker is sent it with its
rank, GPU and engine, and every rank's `ncclCommInitRank` waits for the others (rank 0's runs on a thread while the
workers are watched, so a worker that cannot start is reported, not waited for). A call here is sent to every worker
down its socket, then run here; the engines' DistCollective layers meet in NCCL, which is what keeps the ranks in
step, so nothing waits for the workers' replies: a worker writes back only when a call fails. Every rank's engine
ends with the gathered logits; rank 0's are returned. The same shape as the ONNX Runtime split
(runtime/runners/parallel/ort_group.py), whose `RankFailed`, worker start and timeouts this reuses.

Failure: a worker whose call fails aborts its communicator and reports why; a watchdog thread here reads the report,
or sees a worker process end, then aborts rank 0's communicator (ncclCommAbort: a step waiting in a collective for
that rank ends) and kills the other workers (they wait in theirs). The leader's step raises `RankFailed` naming the
rank, and every later call raises it too: the runner is spent, and the serving loop loads the model again.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Sequence

from llmc.runtime.layout import KVLayout
from llmc.runtime.manifest import TensorRTInfo
from llmc.runtime.runners.protocol import RunnerClosed
from llmc.runtime.runners.parallel.ort_group import READY_TIMEOUT_S, WATCH_INTERVAL_S, RankFailed
from llmc.runtime.runners.parallel.trt_rank import RankGroup
from llmc.runtime.runners.parallel.workers import die_with_parent, serve_calls, start_worker, stop_workers

__all__ = ["RANK_RUNNER", "TrtTensorParallelRunner"]

RANK_RUNNER = "llmc.runtime.runners.parallel.trt_rank:TrtRankRunner"  # what each rank runs ("module:class")


def make_rank(spec: dict, nccl=None):
    """A rank's runner from its spec: the `runner` class ("module:class", a TrtRankRunner) on its engine and GPU."""
    module, name = spec["runner"].split(":")
    runner = getattr(importlib.import_module(module), name)
    group = RankGroup(spec["rank"], spec["world_size"], spec["unique_id"], spec["device"])
    return runner(Path(spec["engine"]), KVLayout.model_validate_json(spec["layout"]), group=group, nccl=nccl,
                  max_batch=spec["max_batch"], capacity=spec["capacity"], max_num_tokens=spec["max_num_tokens"],
                  info=TensorRTInfo.model_validate_json(spec["info"]) if spec["info"] else None)


def rank_main(conn) -> None:
    """A worker (workers.start_worker): told its rank's spec first, it runs that rank's runner on the calls the leader
    sends until it says close (or goes)."""
    die_with_parent()
    spec = conn.recv()
    rank = spec["rank"]
    try:
        runner = make_rank(spec)
    except BaseException as err:  # noqa: BLE001 (everything goes back to the leader)
        conn.send(("error", f"rank {rank} could not load {spec['engine']} on GPU {spec['device']}: "
                            f"{type(err).__name__}: {err}"))
        return
    conn.send(("ready", os.getpid()))
    serve_calls(conn, runner, rank, abort=lambda reason: _quietly(runner.abort))  # this rank's collectives end; the
    # leader aborts its own and stops the others
    with contextlib.suppress(Exception):  # after an abort the stream may hold the error
        runner.close()


def _quietly(call) -> None:
    with contextlib.suppress(Exception):
        call()


class TrtTensorParallelRunner:
    """Rank 0's TrtRankRunner here and one worker process per other rank: `step(...) -> logits`, as TrtRunner."""

    def __init__(self, engines: Sequence[Path], layout: KVLayout, *, max_batch: int, capacity: int,
                 max_num_tokens: int, info: TensorRTInfo | None = None, devices: Sequence[int] | None = None,
                 nccl=None, runner: str = RANK_RUNNER):
        """`engines`: each rank's engine, in rank order; `devices`: each rank's CUDA device (default: rank r on
        device r); `nccl`: the NCCL library (trt_rank.Nccl(), the default) rank 0 makes the group's id with;
        `runner`: the rank runner class, "module:class"."""
        ranks = len(engines)
        if ranks < 2:
            raise ValueError(f"a tensor-parallel runner needs at least 2 ranks' engines (got {ranks}); use TrtRunner")
        devices = list(range(ranks)) if devices is None else list(devices)
        if len(devices) != ranks:
            raise ValueError(f"{ranks} ranks need {ranks} devices, one each (got {devices})")
        if nccl is None:
            from llmc.runtime.runners.parallel.trt_rank import Nccl

            nccl = Nccl()
        self.ranks, self.layout, self.rows, self.capacity = ranks, layout, max_batch, capacity
        self.local, self.conns, self.workers = None, [], []
        self._failure: str | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._ready: set[int] = set()  # the workers that said ready while starting
        unique_id = nccl.unique_id()

        def spec(rank: int) -> dict:
            return dict(rank=rank, world_size=ranks, unique_id=unique_id, device=devices[rank], runner=runner,
                        engine=str(engines[rank]), layout=layout.model_dump_json(), max_batch=max_batch,
                        capacity=capacity, max_num_tokens=max_num_tokens,
                        info=info.model_dump_json() if info is not None else None)

        try:
            for rank in range(1, ranks):
                worker, conn = start_worker(__name__, "rank_main", spec(rank), cwd=Path(engines[rank]).parent)
                self.workers.append(worker)
                self.conns.append(conn)
            self.local = self._start_local(spec(0), nccl)
            deadline = time.monotonic() + READY_TIMEOUT_S
            while len(self._ready) < ranks - 1:
                self._raise_if_a_worker_failed("loading its engine")
                if time.monotonic() > deadline:
                    raise RankFailed(f"a worker did not load its engine within {READY_TIMEOUT_S:.0f} s")
                time.sleep(WATCH_INTERVAL_S / 4)
        except BaseException:
            self.close()
            raise
        self._watchdog = threading.Thread(target=self._watch, name="llmc-trt-ranks-watchdog", daemon=True)
        self._watchdog.start()

    def _start_local(self, spec: dict, nccl):
        """Rank 0's runner, made on a thread (ncclCommInitRank waits for every rank) while the workers are watched:
        one that fails or exits first is reported. Should that happen, the thread closes the runner if it still
        comes (NCCL's bootstrap may keep it waiting: it is left to its daemon thread)."""
        made: dict = {}
        cancelled, lock = threading.Event(), threading.Lock()

        def make() -> None:
            try:
                runner = make_rank(spec, nccl)
            except BaseException as err:  # noqa: BLE001 (raised on the caller's thread)
                made["error"] = err
                return
            with lock:  # whichever of this and the cancel comes second closes it
                made["runner"] = runner
                if cancelled.is_set():
                    runner.close()

        thread = threading.Thread(target=make, name="llmc-trt-rank0-load", daemon=True)
        thread.start()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while thread.is_alive():
            thread.join(WATCH_INTERVAL_S / 4)
            try:
                if thread.is_alive():
                    self._raise_if_a_worker_failed("joining the NCCL group")
                    if time.monotonic() > deadline:
                        raise RankFailed(f"rank 0 did not join the NCCL group within {READY_TIMEOUT_S:.0f} s")
            except BaseException:
                with lock:
                    cancelled.set()
                    if "runner" in made:
                        made["runner"].close()
                raise
        if "error" in made:
            raise RankFailed(f"rank 0 could not load {spec['engine']} on GPU {spec['device']}: "
                             f"{type(made['error']).__name__}: {made['error']}") from made["error"]
        return made["runner"]

    def _raise_if_a_worker_failed(self, doing: str) -> None:
        """While starting: a worker's error report, or its exit, as RankFailed; "ready" replies are noted."""
        for rank, (conn, worker) in enumerate(zip(self.conns, self.workers), start=1):
            if rank in self._ready:
                continue
            try:
                if conn.poll():
                    kind, detail = conn.recv()
                    if kind == "ready":
                        self._ready.add(rank)
                        continue
                    raise RankFailed(detail)
            except (EOFError, OSError):
                pass
            if worker.poll() is not None:
                raise RankFailed(f"rank {rank}'s process exited while {doing} (code {worker.returncode}; its stderr "
                                 "says why)")

    def _problem(self) -> str | None:
        """Once running: a worker's error report (the only thing a worker sends), or a worker process that ended."""
        for rank, (conn, worker) in enumerate(zip(self.conns, self.workers), start=1):
            try:
                if conn.poll():
                    kind, detail = conn.recv()
                    return detail if kind == "error" else f"rank {rank} sent {kind!r} while running"
            except (EOFError, OSError):
                pass
            if worker.poll() is not None:
                return f"rank {rank} (pid {worker.pid}) exited with code {worker.returncode}"
        return None

    def _watch(self) -> None:
        while not self._closed and self._failure is None:
            reason = self._problem()
            if reason is not None and not self._closed:
                self._abort(reason)
                return
            time.sleep(WATCH_INTERVAL_S)

    def _abort(self, reason: str) -> str:
        """Fail the group once, keeping the first reason: rank 0's communicator aborted, the workers killed and
        reaped (their GPUs free before a reload); a second caller waits for that and gets the first reason."""
        with self._lock:
            if self._failure is not None:
                return self._failure
            self._failure = reason
            if self.local is not None:
                with contextlib.suppress(Exception):
                    self.local.abort()
            for worker in self.workers:
                if worker.poll() is None:
                    worker.kill()
            for worker in self.workers:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    worker.wait(timeout=10.0)
            return reason

    @property
    def vocab_size(self) -> int:
        return self.local.vocab_size

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids, rank 1 first."""
        return [w.pid for w in self.workers]

    def step(self, input_ids, cache_position, first_row: int = 0, sequence_lengths=None):
        """Run the step on every rank; rank 0's logits [n, S, vocab]."""
        return self._call("step", input_ids, cache_position, first_row, sequence_lengths)

    def _call(self, method: str, *args):
        if self._closed:
            raise RunnerClosed(f"{method} on a closed TrtTensorParallelRunner")
        if self._failure is not None:
            raise RankFailed(self._failure)
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send((method, args))
            except OSError as err:  # its end is closed: it died before the watchdog saw it
                raise RankFailed(self._abort(f"rank {rank} (pid {self.workers[rank - 1].pid}) cannot be reached: "
                                             f"{type(err).__name__}: {err}")) from err
        try:
            result = getattr(self.local, method)(*args)
        except Exception as err:
            if self._failure is None:  # a worker's report, on its way, names the cause better than rank 0's error
                time.sleep(2 * WATCH_INTERVAL_S)
            raise RankFailed(self._abort(f"rank 0 failed in {method}: {type(err).__name__}: {err}")) from err
        if self._failure is not None:  # aborted while rank 0 ran: its result is not to be trusted
            raise RankFailed(self._failure)
        return result

    def close(self) -> None:
        """Tell the workers to close and close rank 0 alongside (each rank destroys its own communicator), then
        wait for the workers (killing one that is stuck). Calling it again does nothing."""
        if self._closed:
            return
        self._closed = True
        for conn in self.conns:  # first, so the workers close alongside rank 0
            with contextlib.suppress(OSError, ValueError):
                conn.send(("close", ()))
        local, self.local = self.local, None
        try:
            if local is not None:
                local.close()
        except Exception:
            if self._failure is None:  # after an abort, rank 0's stream may hold the error: nothing to report
                raise
        finally:
            stop_workers(self.workers, self.conns)
