"""llmc.AllReduce and llmc.AllGather (runtime/kernels/collective/, the Group in runtime/kernels/collective.py)
between real rank processes: each rank a spawned process running its own ONNX Runtime session (opened through
cpu_kernels.prepare(..., group=)) on a tiny graph, the results compared bit for bit with numpy's for many sizes
(one element, odd sizes, 0-d, 3-D, empty, larger than a slot so the chunks run), both dtypes, 2 and 3 ranks,
many calls in a row per session (each with new data, so both buffers serve), and two collectives in one graph.
Then the failures: Group.abort() ends a blocked call with its reason, a timeout names the missing rank, ranks
passing different shapes, a node's rank or world_size against the group's, a graph without a group.

One pool of three rank processes serves every case (2-rank groups use the first two), fed over pipes."""

from __future__ import annotations

import multiprocessing
import os
import time

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from llmc.runtime.kernels import cpu_kernels
from llmc.runtime.kernels.collective import Group, numa_nodes

CAPACITY = 4096  # bytes a rank puts in a slot per step: 1024 float32 or 2048 float16 elements, so larger inputs chunk
TYPES = {np.float32: TensorProto.FLOAT, np.float16: TensorProto.FLOAT16}
POOL = 3


def collective_model(ops: list[str], rank: int, world: int, dtype=np.float32, *, offset: bool = False
                     ) -> onnx.ModelProto:
    """X -> ops[0] -> ... -> Y, each op an llmc collective of this rank; `offset`: rank + 1 added between them
    (each rank's graph differs, as a tensor-parallel split's do). X and Y have no shape: any rank goes."""
    nodes, inits, current = [], [], "X"
    for i, op in enumerate(ops):
        if i and offset:
            inits.append(numpy_helper.from_array(np.array(rank + 1, dtype=dtype), f"offset{i}"))
            nodes.append(helper.make_node("Add", [current, f"offset{i}"], [f"shifted{i}"]))
            current = f"shifted{i}"
        out = "Y" if i == len(ops) - 1 else f"t{i}"
        nodes.append(helper.make_node(op, [current], [out], name=f"{op.lower()}_{i}", domain="llmc", rank=rank,
                                      world_size=world))
        current = out
    graph = helper.make_graph(nodes, "tp", [helper.make_tensor_value_info("X", TYPES[dtype], None)],
                              [helper.make_tensor_value_info("Y", TYPES[dtype], None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("llmc", 1)])


def open_session(path, group, env=None) -> ort.InferenceSession:
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        model = cpu_kernels.prepare(path, options, group=group)
        return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def _rank_main(conn) -> None:
    """A rank process: ("open", key, path, group, env) / ("run", key, [x, ...]) / ("close", key) / None."""
    sessions = {}
    while (message := conn.recv()) is not None:
        try:
            if message[0] == "open":
                sessions[message[1]] = open_session(*message[2:])
                reply = None
            elif message[0] == "run":
                reply = [sessions[message[1]].run(None, {"X": x})[0] for x in message[2]]
            else:
                reply = sessions.pop(message[1], None) and None
            conn.send(("ok", reply))
        except Exception as err:  # noqa: BLE001 - every failure goes back to the test
            conn.send(("error", str(err)))


class Ranks:
    """The pool: process i is fed messages over its pipe."""

    def __init__(self, count: int):
        context = multiprocessing.get_context("spawn")
        self.pipes, self.processes = [], []
        for _ in range(count):
            parent, child = context.Pipe()
            process = context.Process(target=_rank_main, args=(child,), daemon=True)
            process.start()
            self.pipes.append(parent)
            self.processes.append(process)

    def send(self, i: int, *message) -> None:
        self.pipes[i].send(message)

    def receive(self, i: int, timeout: float = 60) -> tuple[str, object]:
        assert self.pipes[i].poll(timeout), f"rank process {i} did not answer in {timeout} s"
        return self.pipes[i].recv()

    def each(self, messages: list[tuple], timeout: float = 60) -> list:
        """messages[i] to process i, all sent before any answer is read; the answers' values (errors raise)."""
        for i, message in enumerate(messages):
            self.send(i, *message)
        answers = [self.receive(i, timeout) for i in range(len(messages))]
        for status, value in answers:
            assert status == "ok", value
        return [value for _, value in answers]

    def close(self) -> None:
        for pipe, process in zip(self.pipes, self.processes):
            pipe.send(None)
            process.join(10)
            if process.is_alive():
                process.kill()


@pytest.fixture(scope="module")
def ranks():
    cpu_kernels.collective_library()  # built once here, not raced by the rank processes
    pool = Ranks(POOL)
    yield pool
    pool.close()


@pytest.fixture
def group_sessions(ranks, tmp_path):
    """open(ops, world, dtype, ...) -> (group, key): a new group, a session on ranks 0 .. world - 1."""
    groups, opened = [], []

    def open_(ops, world, dtype=np.float32, env=None, only=None, **model_args):
        group = Group.create(world, CAPACITY)
        groups.append(group)
        key = f"{group.name}-{'-'.join(ops)}"
        members = range(world) if only is None else only
        for r in members:
            path = tmp_path / f"{key}-{r}.onnx"
            onnx.save(collective_model(ops, r, world, dtype, **model_args), path)
        ranks.each([("open", key, str(tmp_path / f"{key}-{r}.onnx"), group.name, env or {}) for r in members])
        opened.append((key, list(members)))
        return group, key

    yield open_
    for key, members in opened:
        for r in members:
            ranks.send(r, "close", key)
        for r in members:
            ranks.receive(r)
    for group in groups:
        group.close()
        group.unlink()


REDUCE_SHAPES = [(), (1,), (7,), (3, 5, 7), (1, 576), (2, 1500), (4097,), (0,), (2, 0, 3), (1, 2048), (3, 1025)]
GATHER_SHAPES = [(1,), (7,), (3, 5, 7), (1, 576), (2, 1500), (4, 2049), (1000, 3), (0, 4), (3, 0), (1, 1)]


def inputs(shapes, world, dtype, seed) -> list[list[np.ndarray]]:
    """Per call, each rank's X (new values every call and rank)."""
    rng = np.random.default_rng(seed)
    return [[np.asarray(rng.standard_normal(shape) * 4, dtype=dtype) for _ in range(world)] for shape in shapes]


def summed(xs: list[np.ndarray]) -> np.ndarray:
    """What AllReduce gives: the sum in rank order in float32, rounded once to the input's type."""
    total = xs[0].astype(np.float32)
    for x in xs[1:]:
        total = total + x.astype(np.float32)
    return total.astype(xs[0].dtype)


def run_calls(ranks, key, calls, world) -> list[list[np.ndarray]]:
    """calls[c][r] on rank r, every call in a row in one message per rank; the outputs as [call][rank]."""
    outputs = ranks.each([("run", key, [call[r] for call in calls]) for r in range(world)])
    return [[outputs[r][c] for r in range(world)] for c in range(len(calls))]


def check(got: list[np.ndarray], want: np.ndarray) -> None:
    for out in got:  # every rank, bit for bit
        assert out.dtype == want.dtype and out.shape == want.shape
        np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("world", [2, 3])
def test_all_reduce_matches_numpy(group_sessions, ranks, world, dtype):
    _, key = group_sessions(["AllReduce"], world, dtype)
    rng = np.random.default_rng(world)
    shapes = REDUCE_SHAPES * 2 + [(int(n),) for n in rng.integers(1, 3000, 30)]  # 52 calls in a row per rank
    calls = inputs(shapes, world, dtype, seed=world * 10 + (dtype == np.float16))
    for xs, got in zip(calls, run_calls(ranks, key, calls, world)):
        check(got, summed(xs))


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("world", [2, 3])
def test_all_gather_matches_numpy(group_sessions, ranks, world, dtype):
    _, key = group_sessions(["AllGather"], world, dtype)
    calls = inputs(GATHER_SHAPES * 3, world, dtype, seed=world * 20 + (dtype == np.float16))
    for xs, got in zip(calls, run_calls(ranks, key, calls, world)):
        check(got, np.concatenate(xs, axis=-1))


def test_two_collectives_in_one_graph(group_sessions, ranks):
    """AllReduce, then rank + 1 added (each rank's graph its own), then AllGather: both share the group's steps."""
    world = 3
    _, key = group_sessions(["AllReduce", "AllGather"], world, offset=True)
    calls = inputs([(1, 896), (5, 7), (3, 700), (1,)] * 3, world, np.float32, seed=5)
    for xs, got in zip(calls, run_calls(ranks, key, calls, world)):
        total = summed(xs)
        check(got, np.concatenate([total + np.float32(r + 1) for r in range(world)], axis=-1))


def test_ranks_passing_different_shapes_fail_together_and_go_on(group_sessions, ranks):
    group, key = group_sessions(["AllReduce"], 2)
    ranks.send(0, "run", key, [np.ones(4, np.float32)])
    ranks.send(1, "run", key, [np.ones(5, np.float32)])
    for r in range(2):
        status, message = ranks.receive(r)
        assert status == "error" and "every rank must run the same collectives" in message
        assert "on 4 float elements" in message and "on 5 float elements" in message
    xs = [np.full(3, r + 1, np.float32) for r in range(2)]
    check([out for [out] in ranks.each([("run", key, [x]) for x in xs])], summed(xs))
    assert group.aborted_reason() is None


def test_abort_ends_a_blocked_call_with_its_reason(group_sessions, ranks):
    group, key = group_sessions(["AllReduce"], 2, only=[0])  # rank 1 never comes
    ranks.send(0, "run", key, [np.ones(8, np.float32)])
    time.sleep(0.3)
    assert not ranks.pipes[0].poll(0), "the call returned although rank 1 never called"
    reason = "supervisor: rank 1 (pid 4242) exited with code -9"
    group.abort(reason)
    start = time.monotonic()
    status, message = ranks.receive(0, timeout=10)
    assert time.monotonic() - start < 1.0
    assert status == "error" and reason in message and "aborted" in message
    assert group.aborted_reason() == reason
    ranks.send(0, "run", key, [np.ones(8, np.float32)])  # later calls fail at once
    status, message = ranks.receive(0, timeout=2)
    assert status == "error" and reason in message


def test_timeout_names_the_missing_rank(group_sessions, ranks):
    group, key = group_sessions(["AllGather"], 3, env={"LLMC_COLLECTIVE_TIMEOUT_S": "0.5"}, only=[0, 1])
    start = time.monotonic()
    for r in (0, 1):
        ranks.send(r, "run", key, [np.ones((2, 3), np.float32)])
    for r in (0, 1):
        status, message = ranks.receive(r, timeout=10)
        assert status == "error" and "timed out after 0.5 s" in message and "waiting for rank 2" in message, message
    assert time.monotonic() - start < 5
    assert "waiting for rank 2" in group.aborted_reason()


@pytest.fixture
def group_of_two():
    with Group.create(2, CAPACITY) as group:
        yield group


def _session_error(tmp_path, model, group) -> str:
    onnx.save(model, tmp_path / "m.onnx")
    with pytest.raises(Exception) as raised:
        open_session(tmp_path / "m.onnx", group)
    return str(raised.value)


def test_node_against_the_group(tmp_path, group_of_two):
    message = _session_error(tmp_path, collective_model(["AllReduce"], 0, 3), group_of_two.name)
    assert "world_size is 3" in message and "world_size 2" in message
    message = _session_error(tmp_path, collective_model(["AllGather"], 2, 2), group_of_two.name)
    assert "rank is 2" in message and "world_size 2" in message
    message = _session_error(tmp_path, collective_model(["AllReduce"], 0, 2), "llmc-no-such-group")
    assert "'llmc-no-such-group' does not exist" in message


def test_a_rank_is_one_process(tmp_path, ranks, group_of_two):
    """Rank 0 held by this process refuses a second process; released with the session, it is free again."""
    onnx.save(collective_model(["AllReduce"], 0, 2), tmp_path / "r0.onnx")
    held = open_session(tmp_path / "r0.onnx", group_of_two.name)
    ranks.send(0, "open", "second", str(tmp_path / "r0.onnx"), group_of_two.name, {})
    status, message = ranks.receive(0)
    assert status == "error" and f"already run by process {os.getpid()}" in message
    del held
    ranks.each([("open", "second", str(tmp_path / "r0.onnx"), group_of_two.name, {})])
    ranks.each([("close", "second")])


def test_a_collective_graph_needs_a_group_and_sequential_execution(tmp_path):
    onnx.save(collective_model(["AllReduce", "AllGather"], 0, 2), tmp_path / "m.onnx")
    with pytest.raises(ValueError, match=r"llmc.AllReduce node 'allreduce_0'.*runs only inside a rank group"):
        cpu_kernels.prepare(tmp_path / "m.onnx", ort.SessionOptions())
    options = ort.SessionOptions()
    options.execution_mode = ort.ExecutionMode.ORT_PARALLEL
    with pytest.raises(ValueError, match="ORT_SEQUENTIAL"):
        cpu_kernels.prepare(tmp_path / "m.onnx", options, group="any")


def test_prepare_leaves_other_graphs_alone(tmp_path):
    graph = helper.make_graph([helper.make_node("Relu", ["X"], ["Y"])], "g",
                              [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2])])
    onnx.save(helper.make_model(graph), tmp_path / "plain.onnx")
    path = tmp_path / "plain.onnx"
    assert cpu_kernels.prepare(path, ort.SessionOptions(), group="ignored") == str(path)


def test_group_create_attach_and_unlink():
    with Group.create(3, capacity_bytes=1000) as group:
        assert (group.world_size, group.capacity_bytes) == (3, 1024)  # a multiple of 64
        peer = Group.attach(group.name)
        assert (peer.world_size, peer.capacity_bytes, peer.is_leader) == (3, 1024, False)
        assert peer.steps() == [0, 0, 0] and peer.aborted_reason() is None
        peer.abort("stop")
        assert group.aborted_reason() == "stop"
        peer.close()
    with pytest.raises(FileNotFoundError):
        Group.attach(group.name)
    with pytest.raises(ValueError, match="world_size 65"):
        Group.create(65)


def test_numa_nodes(tmp_path):
    for node, cpus in {0: "0-3,8\n", 1: "4-7\n"}.items():
        (tmp_path / f"node{node}").mkdir()
        (tmp_path / f"node{node}" / "cpulist").write_text(cpus)
    assert numa_nodes(tmp_path) == {0: [0, 1, 2, 3, 8], 1: [4, 5, 6, 7]}
    assert sorted(cpu for cpus in numa_nodes().values() for cpu in cpus)  # this machine's: at least one CPU
