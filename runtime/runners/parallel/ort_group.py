"""Run a paged graph split over N ranks (tensor parallelism): rank 0 in this process, ranks 1 .. N-1 in worker
processes, stepping in lockstep.

`TensorParallelRunner` is a drop-in for `PagedRunner` (runtime/runners/paged.py): the same `step(rows)`,
`copy_blocks`, `close`, `block_size`, `nbytes`. Each rank is a `PagedRunner` over its own graph (its heads, its
slices of the projections) and its own block pools (its KV heads). A call here is sent to every worker down a
pipe, then run here; the ranks' graphs meet in their collectives (llmc.AllReduce / AllGather, runtime/kernels/
collective.py), which is what keeps them in step, so nothing waits for the workers' replies: a worker writes
back only when a call fails. Every rank's graph ends with the gathered logits; rank 0's are returned. This is
TensorRT-LLM's orchestrator shape: the leader schedules and samples, the workers run their graph on the same
packed inputs. Where the machine has several NUMA nodes, each rank runs on one (rank_cpus).

Failure: a worker whose call fails aborts the group (so the ranks blocked in a collective return at once) and
reports why; a worker process that dies is seen by a watchdog thread, which aborts the group. Either way the
leader's step raises `RankFailed` naming the rank, and every later call raises it too: the runner is spent,
and the engine's owner (the served model, its supervisor) builds a new one. No call waits forever.
"""

from __future__ import annotations

import contextlib
import multiprocessing.connection
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Collection, Iterable, Sequence

from llmc.runtime.layout import KVLayout
from llmc.runtime.runners.paged import PagedRunner, RowStep
from llmc.runtime.runners.protocol import RunnerBroken, RunnerClosed
from llmc.runtime.runners.parallel.workers import die_with_parent, serve_calls, start_worker, stop_workers

__all__ = ["RankFailed", "TensorParallelRunner"]

READY_TIMEOUT_S = 600.0  # a worker loads its graph: minutes for a large model
WATCH_INTERVAL_S = 0.2  # how soon a dead worker is noticed (and the ranks waiting on it released)


class RankFailed(RunnerBroken):
    """A rank of a tensor-parallel runner failed or died; the runner cannot step again."""


def rank_main(conn: multiprocessing.connection.Connection) -> None:
    """A worker (workers.start_worker): told its rank's spec first, it runs that rank's PagedRunner on the calls the
    leader sends until it says close (or goes)."""
    from llmc.runtime.kernels.collective import Group

    die_with_parent()
    spec = conn.recv()
    rank, group = spec["rank"], spec["group"]
    if spec["cpus"]:  # before ONNX Runtime starts its threads (they inherit it): the weights land on its node
        for thread in os.listdir("/proc/self/task"):  # every thread there is (numpy's BLAS pool, the watcher)
            os.sched_setaffinity(int(thread), spec["cpus"])
    try:
        runner = PagedRunner(Path(spec["graph"]), KVLayout.model_validate_json(spec["layout"]),
                             num_blocks=spec["num_blocks"], max_num_tokens=spec["max_num_tokens"],
                             num_threads=spec["num_threads"], spin_after_run=spec["spin_after_run"], group=group)
    except BaseException as err:  # noqa: BLE001 (everything goes back to the leader)
        conn.send(("error", f"rank {rank} could not load {spec['graph']}: {type(err).__name__}: {err}"))
        return
    conn.send(("ready", os.getpid()))
    serve_calls(conn, runner, rank, abort=lambda reason: Group.attach(group).abort(reason))
    runner.close()


def rank_cpus(ranks: int, nodes: dict[int, list[int]] | None = None, allowed: Collection[int] | None = None
              ) -> list[list[int]] | None:
    """The CPUs each rank runs on where this machine has several NUMA nodes (`nodes`: collective.numa_nodes(), by
    default this machine's), else None: the ranks spread over the nodes in order (rank r on node r * nodes //
    ranks: 2 ranks on 2 sockets, one each; 4 ranks, two a socket), each node's CPUs cut to those this process may
    use (`allowed`: its affinity, a container's cpuset). A rank's memory is then read from its own node: its pages
    are first touched by its pinned threads. vLLM's CPU backend binds its ranks the same way."""
    from llmc.runtime.kernels.collective import numa_nodes

    allowed = set(os.sched_getaffinity(0) if allowed is None else allowed)
    usable = [cpus for _, cpus in sorted((numa_nodes() if nodes is None else nodes).items())
              if allowed.intersection(cpus)]
    if len(usable) < 2:
        return None
    return [sorted(allowed.intersection(usable[r * len(usable) // ranks])) for r in range(ranks)]


@contextlib.contextmanager
def _pinned(cpus: Collection[int] | None):
    """Run the block on `cpus` (the calling thread only: Linux's sched_setaffinity of pid 0), then as before;
    threads started inside it keep `cpus`."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


class TensorParallelRunner:
    """Rank 0's PagedRunner here and one worker process per other rank: `step(rows) -> logits`, as PagedRunner."""

    def __init__(self, graphs: Sequence[Path], layout: KVLayout, *, num_blocks: int, max_num_tokens: int,
                 num_threads: int = 0, spin_after_run: bool = True, cpus: Sequence[Collection[int]] | None | str = "numa"):
        """`graphs`: each rank's graph, in rank order; `num_threads`: each rank's intra-op threads (0: the
        cores divided among the ranks); `cpus`: the CPUs each rank's threads run on, "numa" (the default): a NUMA
        node each where the machine has several (rank_cpus), None: wherever the OS puts them."""
        from llmc.runtime.kernels.collective import Group

        ranks = len(graphs)
        if ranks < 2:
            raise ValueError(f"a tensor-parallel runner needs at least 2 ranks' graphs (got {ranks}); use PagedRunner")
        self.ranks, self.layout, self.num_blocks = ranks, layout, num_blocks
        self.cpus = rank_cpus(ranks) if cpus == "numa" else [sorted(c) for c in cpus] if cpus is not None else None
        threads = num_threads or max(1, (os.cpu_count() or 1) // ranks)
        self.group = Group.create(ranks)
        self._failure: str | None = None
        self._closed = False
        self.conns, self.workers = [], []
        try:
            for rank in range(1, ranks):
                worker, conn = start_worker(__name__, "rank_main", dict(
                    graph=str(graphs[rank]), layout=layout.model_dump_json(), group=self.group.name, rank=rank,
                    num_blocks=num_blocks, max_num_tokens=max_num_tokens, num_threads=threads,
                    spin_after_run=spin_after_run, cpus=self.cpus[rank] if self.cpus else None),
                    cwd=Path(graphs[rank]).parent)
                self.workers.append(worker)
                self.conns.append(conn)
            with _pinned(self.cpus[0] if self.cpus else None):  # rank 0's thread pool starts on its node's CPUs
                self.local = PagedRunner(Path(graphs[0]), layout, num_blocks=num_blocks, max_num_tokens=max_num_tokens,
                                         num_threads=threads, spin_after_run=spin_after_run, group=self.group.name)
            for rank, conn in enumerate(self.conns, start=1):
                if not conn.poll(READY_TIMEOUT_S):
                    raise RankFailed(f"rank {rank} did not load its graph within {READY_TIMEOUT_S:.0f} s")
                try:
                    kind, detail = conn.recv()
                except (EOFError, OSError):
                    kind, detail = "error", f"rank {rank}'s process exited while loading its graph (code " \
                                            f"{self.workers[rank - 1].wait()}; its stderr says why)"
                if kind != "ready":
                    raise RankFailed(detail)
        except BaseException:
            self.close()
            raise
        self._watchdog = threading.Thread(target=self._watch, name="llmc-ranks-watchdog", daemon=True)
        self._watchdog.start()

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def vocab_size(self) -> int:
        return self.local.vocab_size

    @property
    def max_num_tokens(self) -> int:
        return self.local.max_num_tokens

    @property
    def nbytes(self) -> int:
        """The pools' bytes, all ranks together (each rank holds the same share)."""
        return self.local.nbytes * self.ranks

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids, rank 1 first."""
        return [w.pid for w in self.workers]

    def step(self, rows: Sequence[RowStep]):
        """Run the rows on every rank; rank 0's logits of each row's last `num_logits` tokens, in row order."""
        return self._call("step", list(rows))

    def copy_blocks(self, pairs: Iterable[tuple[int, int]]) -> None:
        """Copy block `src` onto block `dst` in every pool of every rank, for each `(src, dst)`."""
        self._call("copy_blocks", [tuple(p) for p in pairs])

    def _call(self, method: str, arg):
        if self._closed:
            raise RunnerClosed(f"{method} on a closed TensorParallelRunner")
        if self._failure is not None:
            raise RankFailed(self._failure)
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send((method, (arg,)))
            except OSError as err:  # the worker's end is closed: it died before the watchdog saw it
                raise RankFailed(self._fail(self._gone(rank, err))) from err
        try:
            result = getattr(self.local, method)(arg)
        except Exception as err:
            raise RankFailed(self._fail(f"rank 0 failed in {method}: {type(err).__name__}: {err}")) from err
        if any(conn.poll() for conn in self.conns):  # a worker failed after rank 0 passed its collectives
            raise RankFailed(self._fail(f"a worker failed in {method}"))
        return result

    def _gone(self, rank: int, err: OSError) -> str:
        """Why worker `rank` cannot be reached: its exit code, as the watchdog would say it, once it has one."""
        worker = self.workers[rank - 1]
        try:
            worker.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            return f"rank {rank} (pid {worker.pid}) cannot be reached: {type(err).__name__}: {err}"
        return f"rank {rank} (pid {worker.pid}) exited with code {worker.returncode}"

    def _fail(self, fallback: str) -> str:
        """The first failure: a worker's own report if one arrived (it is the cause), else `fallback`."""
        if self._failure is None:
            for conn in self.conns:
                try:
                    if conn.poll(0.5):
                        kind, detail = conn.recv()
                        if kind == "error":
                            self._failure = detail
                            break
                except (EOFError, OSError):
                    continue
            self._failure = self._failure or self.group.aborted_reason() or fallback
            self.group.abort(self._failure)
        return self._failure

    def _watch(self) -> None:
        """Abort the group when a worker process ends while the runner is open (checked every WATCH_INTERVAL_S)."""
        while not self._closed:
            for rank, worker in enumerate(self.workers, start=1):
                if worker.poll() is not None and not self._closed:
                    self.group.abort(f"rank {rank} (pid {worker.pid}) exited with code {worker.returncode}")
                    return
            time.sleep(WATCH_INTERVAL_S)

    def close(self) -> None:
        """Stop the workers, drop rank 0's runner and the group; calling it again does nothing."""
        if self._closed:
            return
        self._closed = True
        stop_workers(self.workers, self.conns)
        local = getattr(self, "local", None)
        if local is not None:
            local.close()
        self.group.close()
        self.group.unlink()
