"""Tensor parallelism end to end on CPU: a spec's `parallel.tensor` builds one graph per rank, verified against the
unsplit PyTorch model with the ranks as processes summing through llmc's collective kernel; the packaged model
serves greedy tokens equal to PyTorch's, and a rank killed under load ends its requests with an error while the
model comes back (runtime/runners/parallel/ort_group.py)."""

import os
import signal
import time
from pathlib import Path

import numpy as np
import onnx
import pytest

from checkpoints import byte_tokenizer, make_checkpoint
from checkpoints import TINY_SERVING_SPEC
from serving_rig import RecordingSink, greedy_reference, request_inputs
from shared_builds import build_reusing_export
from llmc.compiler import build
from llmc.compiler.spec import parse_spec
from llmc.errors import UnsupportedError
from llmc.runtime.runners.paged import RowStep
from llmc.runtime.runners.parallel.ort_group import RankFailed, TensorParallelRunner, rank_cpus


@pytest.fixture(scope="module")
def split_llama(tiny_checkpoints, tmp_path_factory):
    """The tiny Llama split over 2 ranks, built through packaging (verify included)."""
    spec = parse_spec({"name": "tiny", "source": str(tiny_checkpoints["llama"]), "parallel": {"tensor": 2},
                       **TINY_SERVING_SPEC})
    return build(spec, output=tmp_path_factory.mktemp("tp") / "tiny")


def _collectives(path: Path) -> list[tuple[str, int, int]]:
    graph = onnx.load(str(path), load_external_data=False).graph
    return [(n.op_type, *(a.i for a in sorted(n.attribute, key=lambda a: a.name))) for n in graph.node
            if n.domain == "llmc" and n.op_type in ("AllReduce", "AllGather")]


def test_each_rank_gets_its_graph_and_the_ranks_verify_against_pytorch(split_llama):
    exported, folder = split_llama.exported, split_llama.artifacts["export"].folder
    assert exported.tensor_parallel == 2 and sorted(exported.files) == ["rank0/model.onnx", "rank1/model.onnx"]
    assert exported.kv_layout.num_kv_heads == exported.model.num_kv_heads // 2  # a rank's pools hold its KV heads
    for rank, graph in enumerate(exported.graphs(folder)):
        # two all-reduces a layer (attention out, MLP down), one gather of the LM head's vocabulary slices
        assert _collectives(graph) == [("AllReduce", rank, 2)] * 2 * exported.model.num_layers + [("AllGather", rank, 2)]
    report = split_llama.verify
    assert report.passed and "split over 2 ranks" in report.candidate
    assert all(c.token_agreement == 1.0 for c in report.cases)


@pytest.mark.parametrize("model_type, ranks, config", [
    ("gpt_oss", 2, {}),  # sinks, alternating windows, biased experts split by their intermediate channels
    ("qwen2", 3, dict(num_attention_heads=6, num_key_value_heads=3, hidden_size=96, intermediate_size=192)),
])
def test_other_families_and_three_ranks_verify(tmp_path, model_type, ranks, config):
    path = make_checkpoint(model_type, tmp_path / "m", **config)
    spec = parse_spec({"name": "t", "source": str(path), "parallel": {"tensor": ranks}})
    result = build(spec, output=tmp_path / "out", until="verify")
    assert result.exported.tensor_parallel == ranks and result.verify.passed, result.verify


def test_a_split_the_heads_do_not_allow_stops_before_anything_loads(tiny_checkpoints, tmp_path):
    spec = parse_spec({"name": "t", "source": str(tiny_checkpoints["llama"]), "parallel": {"tensor": 3}})
    with pytest.raises(UnsupportedError, match=r"parallel.tensor \(3\) must divide the model's 4 attention heads"):
        build(spec, output=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_plan_shows_each_ranks_memory(tiny_checkpoints):
    from llmc.compiler.pipeline.plan import plan_build

    one = plan_build(parse_spec({"name": "t", "source": str(tiny_checkpoints["llama"])}))
    two = plan_build(parse_spec({"name": "t", "source": str(tiny_checkpoints["llama"]), "parallel": {"tensor": 2}}))
    assert two.rank_kv_cache_bytes * 2 == one.kv_cache_bytes
    assert one.weights_bytes / 2 < two.rank_weights_bytes < one.weights_bytes  # the embeddings are replicated
    assert ("tensor parallelism", ) == tuple(r[0] for r in two.rows() if r[0] == "tensor parallelism")


def _runner(split_llama) -> TensorParallelRunner:
    exported = split_llama.exported
    return TensorParallelRunner(exported.graphs(split_llama.artifacts["export"].folder), exported.kv_layout, num_blocks=8,
                                max_num_tokens=64, num_threads=1)


def test_a_killed_rank_fails_the_step_at_once_naming_it(split_llama):
    runner = _runner(split_llama)
    try:
        first = runner.step([RowStep([1, 2, 3], 0, [0], num_logits=1)])
        assert first.shape == (1, split_llama.exported.model.vocab_size)
        os.kill(runner.pids[0], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(RankFailed, match=r"rank 1 \(pid \d+\) exited"):
            for _ in range(200):  # until the watchdog has seen it (steps before then may still pass)
                runner.step([RowStep([4], 3, [0], num_logits=1)])
                time.sleep(0.01)
        assert time.monotonic() - start < 10
        with pytest.raises(RankFailed):  # spent: every later call says why
            runner.step([RowStep([4], 3, [0])])
    finally:
        runner.close()
    assert not Path("/dev/shm", runner.group.name).exists()


def test_ranks_run_a_numa_node_each_where_the_machine_has_several(tmp_path):
    from llmc.runtime.kernels.collective import numa_nodes

    for node, cpus in ((0, "0-3"), (1, "4-7\n")):
        (tmp_path / f"node{node}").mkdir()
        (tmp_path / f"node{node}" / "cpulist").write_text(cpus)
    nodes = numa_nodes(tmp_path)
    assert rank_cpus(2, nodes, allowed=range(8)) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert rank_cpus(4, nodes, allowed=range(8)) == [[0, 1, 2, 3]] * 2 + [[4, 5, 6, 7]] * 2
    assert rank_cpus(2, nodes, allowed=[1, 2, 5]) == [[1, 2], [5]]  # a container's cpuset
    assert rank_cpus(2, nodes, allowed=range(4)) is None  # inside one node: nothing to pin
    assert rank_cpus(2, {0: list(range(8))}, allowed=range(8)) is None


def _threads_on(pid: int) -> dict[int, str]:
    found = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        status = (task / "status").read_text()
        found[int(task.name)] = status.split("Cpus_allowed_list:")[1].split()[0]
    return found


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning two ranks apart needs two CPUs")
def test_pinned_ranks_run_their_threads_on_their_cpus(split_llama):
    first, second = sorted(os.sched_getaffinity(0))[:2]
    before, ours = os.sched_getaffinity(0), set(_threads_on(os.getpid()))
    exported = split_llama.exported
    runner = TensorParallelRunner(exported.graphs(split_llama.artifacts["export"].folder), exported.kv_layout,
                                  num_blocks=8, max_num_tokens=64, num_threads=2, cpus=[[first], [second]])
    try:
        assert runner.step([RowStep([1, 2, 3], 0, [0], num_logits=1)]).shape[0] == 1
        assert set(_threads_on(runner.pids[0]).values()) == {str(second)}  # the worker, all its threads
        started = {t: cpus for t, cpus in _threads_on(os.getpid()).items()
                   if t not in ours and t != runner._watchdog.native_id}
        assert started and set(started.values()) == {str(first)}  # rank 0's thread pool, started pinned
        assert os.sched_getaffinity(0) == before  # the calling thread as it was
    finally:
        runner.close()


def test_a_step_sent_to_a_rank_already_dead_names_that_rank(split_llama):
    # Before the watchdog sees the death, sending the step fails (a broken pipe): that is rank 1's failure, not
    # rank 0's.
    runner = _runner(split_llama)
    try:
        os.kill(runner.pids[0], signal.SIGKILL)
        runner.workers[0].wait()
        with pytest.raises(RankFailed, match=r"rank 1 \(pid \d+\) exited with code -9"):
            runner.step([RowStep([1, 2, 3], 0, [0], num_logits=1)])
    finally:
        runner.close()


def test_a_rank_failing_its_call_stops_the_others(split_llama):
    runner = _runner(split_llama)
    try:
        with pytest.raises(RankFailed, match="block ids must be in 0..7"):
            runner.copy_blocks([(0, 9)])
    finally:
        runner.close()
    assert all(w.poll() is not None for w in runner.workers)


def test_the_split_model_serves_equal_to_pytorch_and_comes_back_after_a_rank_dies(split_llama, tiny_checkpoints):
    from llmc.compiler.source import inspect_source, load_model
    from llmc.compiler.spec import SourceSpec
    from llmc.runtime.serving.loop import ServingLoop

    loop = ServingLoop.from_manifest(split_llama.repository / "tiny" / "1").start()
    try:
        model, _ = load_model(inspect_source(SourceSpec(path=tiny_checkpoints["llama"])))
        expected = greedy_reference(model, byte_tokenizer().encode("hello there").ids, 12, end_ids=(2,))
        sink = RecordingSink()
        loop.submit(request_inputs(max_tokens=12), sink)
        assert sink.joined("output_ids").tolist() == expected

        streaming = RecordingSink()
        rank = loop.engine.runner.pids[0]
        os.kill(rank, signal.SIGSTOP)  # stopped first: the stream cannot end before the kill (a tiny model is fast)
        loop.submit(request_inputs(max_tokens=100, stream=True), streaming)
        os.kill(rank, signal.SIGKILL)  # under load: the request is in flight, its steps wait for the rank
        streaming.wait()
        assert streaming.errors and "rank 1" in streaming.errors[0], streaming.errors
        after = RecordingSink()  # the loop loaded the model again: it serves as before
        loop.submit(request_inputs(max_tokens=12), after)
        assert after.joined("output_ids").tolist() == expected
    finally:
        loop.stop()
    assert np.all([w.poll() is not None for w in loop.engine.runner.workers])


def test_a_draft_beside_a_split_target_runs_whole_and_serves_equal_to_pytorch(tiny_checkpoints, tmp_path_factory):
    # A self-draft of a split target: the target's checkpoint exported whole, verified, quantized; it runs in the
    # leader's process beside the ranks and reads their block tables.
    from llmc.compiler.source import inspect_source, load_model
    from llmc.compiler.spec import SourceSpec
    from llmc.runtime.serving.loop import ServingLoop

    spec = parse_spec({"name": "tiny", "source": str(tiny_checkpoints["llama"]), "parallel": {"tensor": 2},
                       "speculative": {"method": "draft", "num_tokens": 3,
                                       "draft": {"quantization": {"mode": "int8-weight-only"}}},
                       **TINY_SERVING_SPEC})
    result = build_reusing_export(tmp_path_factory, spec, tmp_path_factory.mktemp("tp-draft") / "tiny")
    draft = result.artifacts["draft"]
    assert draft.artifact.source == "self" and "greedy tokens equal" in draft.artifact.verified  # exported whole, verified
    assert not _collectives(draft.folder / draft.artifact.onnx)  # whole: no collective in the draft's graph

    model, _ = load_model(inspect_source(SourceSpec(path=tiny_checkpoints["llama"])))
    loop = ServingLoop.from_manifest(result.repository / "tiny" / "1").start()
    try:
        assert len(loop.engine.runner.pids) == 1  # the split target's worker; the draft is in this process
        for prompt in ("hello there", "the quick brown fox"):
            expected = greedy_reference(model, byte_tokenizer().encode(prompt).ids, 24, end_ids=(2,))
            sink = RecordingSink()
            loop.submit(request_inputs(prompt, max_tokens=24), sink)
            assert sink.joined("output_ids").tolist() == expected
            assert len(set(expected)) > 1  # not one repeated token
        assert loop.engine.speculator.num_accepted_tokens > 0  # the draft's tokens were taken
    finally:
        loop.stop()
