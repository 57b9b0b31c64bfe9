"""A split TensorRT engine's leader (runtime/runners/parallel/trt_group.py) over stand-in rank runners, in real
worker processes: every rank gets the group's NCCL id, its rank and its GPU, and every call, in the same order; the
stand-in's step meets the other ranks' at a barrier, as an engine's NCCL collectives do, and its abort() ends that
wait, as ncclCommAbort does. A worker that fails or dies, or rank 0 failing, makes the step raise RankFailed naming
the rank, and every later call too; a worker that cannot load its engine fails the start. The TrtRankRunner itself
is tested in test_trt_rank.py; the real 2-GPU run is tests/gpu/test_tensorrt_split_serving.py."""

import types

import numpy as np
import pytest

from llmc.runtime.layout import KVLayout
from llmc.runtime.runners.protocol import RunnerClosed
from llmc.runtime.runners.parallel.ort_group import RankFailed
from llmc.runtime.runners.parallel.trt_group import TrtTensorParallelRunner

FAKE_RANK = '''
import os, time
from pathlib import Path

import numpy as np


class FakeRank:
    """A rank: it joins the group (waits for every rank's `joined`, as ncclCommInitRank), and its step meets the other
    ranks' at a barrier of files (as the engine's collectives do); abort() ends the wait, as ncclCommAbort."""

    def __init__(self, engine_path, layout, *, group, nccl=None, max_batch, capacity, max_num_tokens, info=None):
        self.folder, self.group = Path(engine_path).parent, group
        self.root, self.layout, self.rows, self.capacity = self.folder.parent, layout, max_batch, capacity
        self.vocab_size = 5
        self.calls, self.aborted = 0, False
        if (self.folder / "fail_load").exists():
            raise RuntimeError("the engine does not deserialize")
        (self.folder / "joined").write_text(f"{group.unique_id.hex()} {group.device} {group.rank} {group.world_size} "
                                            f"{max_batch} {capacity} {max_num_tokens} {info is not None}")
        deadline = time.monotonic() + 5
        while not all((self.root / f"rank{r}" / "joined").exists() for r in range(group.world_size)):
            if time.monotonic() > deadline:
                raise RuntimeError("nobody joined")
            time.sleep(0.01)

    def step(self, input_ids, cache_position, first_row=0, sequence_lengths=None):
        n, self.calls = self.calls, self.calls + 1
        with open(self.folder / "calls.txt", "a") as f:
            f.write(f"{n} {input_ids.tolist()} {cache_position.tolist()} {first_row} {sequence_lengths}\\n")
        failing = self.folder / "fail_at"
        if failing.exists() and int(failing.read_text().split()[1]) == n:
            if failing.read_text().split()[0] == "die":
                os._exit(3)
            raise RuntimeError("CUDA error 700")
        (self.root / f"step{n}.rank{self.group.rank}").touch()
        while not all((self.root / f"step{n}.rank{r}").exists() for r in range(self.group.world_size)):
            if self.aborted:
                raise RuntimeError("NCCL communicator aborted")
            time.sleep(0.01)
        return np.full((*input_ids.shape, 5), float(input_ids.sum() + self.group.rank), np.float32)

    def abort(self):
        self.aborted = True
        (self.folder / "aborted").touch()

    def close(self):
        (self.folder / "closed").touch()
'''
LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", in_place=True)
NCCL = types.SimpleNamespace(unique_id=lambda: bytes(range(128)))


@pytest.fixture
def ranks(tmp_path, monkeypatch):
    """`make(n, **faults)`: the runner over n stand-in ranks; faults: rank -> "fail_load" | "raise k" | "die k"."""
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "llmc_fake_rank.py").write_text(FAKE_RANK)
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))  # the workers' import path is this process's
    runners = []

    def make(n, faults=None, **options):
        engines = []
        for r in range(n):
            (tmp_path / f"rank{r}").mkdir()
            (tmp_path / f"rank{r}" / "model.plan").write_bytes(b"plan")
            fault = (faults or {}).get(r)
            if fault == "fail_load":
                (tmp_path / f"rank{r}" / "fail_load").touch()
            elif fault:
                (tmp_path / f"rank{r}" / "fail_at").write_text(fault)
            engines.append(tmp_path / f"rank{r}" / "model.plan")
        runner = TrtTensorParallelRunner(engines, LAYOUT, max_batch=2, capacity=16, max_num_tokens=8, nccl=NCCL,
                                         runner="llmc_fake_rank:FakeRank", **options)
        runners.append(runner)
        return runner

    yield make, tmp_path
    for runner in runners:
        runner.close()


def _step(runner, k=0):
    return runner.step(np.array([[3 + k], [4]]), np.array([5, 6]), first_row=0)


def test_every_rank_joins_with_the_group_id_on_its_gpu_and_runs_every_call_in_order(ranks):
    make, folder = ranks
    runner = make(3, devices=[2, 0, 1])
    joined = [(folder / f"rank{r}" / "joined").read_text().split() for r in range(3)]
    assert [j[0] for j in joined] == [bytes(range(128)).hex()] * 3
    assert [j[1:] for j in joined] == [[d, str(r), "3", "2", "16", "8", "False"] for r, d in enumerate("201")]
    assert runner.rows == 2 and runner.capacity == 16 and runner.vocab_size == 5
    for k in range(3):
        logits = _step(runner, k)
        assert logits.shape == (2, 1, 5) and np.all(logits == 7 + k)  # rank 0's
    runner.step(np.array([[1, 2, 3]]), np.array([0]), first_row=1)
    calls = [(folder / f"rank{r}" / "calls.txt").read_text() for r in range(3)]
    assert calls[0] == calls[1] == calls[2] and calls[0].count("\n") == 4 and "[[1, 2, 3]] [0] 1 None" in calls[0]
    workers = [w for w in runner.workers]
    runner.close()
    assert all((folder / f"rank{r}" / "closed").exists() for r in range(3))
    assert [w.returncode for w in workers] == [0, 0]
    with pytest.raises(RunnerClosed):
        _step(runner)


@pytest.mark.parametrize("faults, reason", [
    ({2: "raise 1"}, r"rank 2 failed in step: RuntimeError: CUDA error 700"),
    ({1: "die 1"}, r"rank 1 \(pid \d+\) exited with code 3"),
    ({0: "raise 1"}, r"rank 0 failed in step: RuntimeError: CUDA error 700")])
def test_a_failed_or_dead_rank_fails_the_step_naming_it_and_spends_the_runner(ranks, faults, reason):
    make, folder = ranks
    runner = make(3, faults)
    _step(runner)
    with pytest.raises(RankFailed, match=reason):
        _step(runner, 1)
    assert (folder / "rank0" / "aborted").exists()  # rank 0's communicator aborted (what released its wait)
    assert all(w.poll() is not None for w in runner.workers)  # the others, waiting in their collectives, stopped
    with pytest.raises(RankFailed, match=reason):  # spent: later calls say why, and run nothing
        _step(runner, 2)
    assert (folder / "rank0" / "calls.txt").read_text().count("\n") == 2
    runner.close()


def test_a_worker_that_cannot_load_its_engine_fails_the_start_naming_it(ranks):
    make, folder = ranks
    with pytest.raises(RankFailed, match=r"rank 1 could not load .*rank1/model.plan on GPU 1: RuntimeError: the "
                                         r"engine does not deserialize"):
        make(2, {1: "fail_load"})


def test_a_split_needs_two_ranks_and_a_device_each():
    with pytest.raises(ValueError, match="at least 2 ranks' engines"):
        TrtTensorParallelRunner(["model.plan"], LAYOUT, max_batch=1, capacity=8, max_num_tokens=8, nccl=NCCL)
    with pytest.raises(ValueError, match=r"2 ranks need 2 devices"):
        TrtTensorParallelRunner(["a", "b"], LAYOUT, max_batch=1, capacity=8, max_num_tokens=8, nccl=NCCL, devices=[0])
