"""Quantizing a split model (parallel.tensor): the ranks quantize together, a process each, their collectives meeting
(compiler/quantize/ranks.py). With blocks on the rank boundaries, round to nearest gives the whole model's int4
model, split; AWQ runs its calibration through the ranks in lockstep; a rank that fails ends the build naming it."""

import multiprocessing.connection
import socket
import subprocess
import sys

import numpy as np
import onnx
import pytest

from checkpoints import TINY_SERVING_SPEC
from shared_builds import build_reusing_export
from llmc.compiler.quantize.ranks import _supervise
from llmc.compiler.spec import parse_spec
from llmc.errors import QuantizationError
from llmc.runtime.kernels.collective import Group
from llmc.runtime.runners.paged import PagedRunner, RowStep
from llmc.runtime.runners.parallel.ort_group import TensorParallelRunner

RTN = {"mode": "int4-weight-only", "algorithm": "rtn", "block_size": 32}  # 32: the tiny Llama's o_proj has 32
# input channels a rank (2 of 4 heads of 16), its down_proj 64: every block on a rank boundary


def _ops(path) -> list[str]:
    return [n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node]


def _greedy(runner, prompt: list[int], steps: int) -> tuple[list[int], np.ndarray]:
    logits = runner.step([RowStep(prompt, 0, [0, 1], num_logits=1)])
    first, tokens = logits[0], [int(logits[0].argmax())]
    for k in range(steps - 1):
        tokens.append(int(runner.step([RowStep([tokens[-1]], len(prompt) + k, [0, 1], num_logits=1)])[0].argmax()))
    return tokens, first


def test_round_to_nearest_on_rank_boundaries_is_the_whole_models_int4_split(tiny_checkpoints, tmp_path_factory):
    base = {"name": "tiny", "source": str(tiny_checkpoints["llama"]), "quantization": RTN, **TINY_SERVING_SPEC}
    split = build_reusing_export(tmp_path_factory, parse_spec({**base, "parallel": {"tensor": 2}}),
                                 tmp_path_factory.mktemp("q-split") / "tiny", until="quantize")
    whole = build_reusing_export(tmp_path_factory, parse_spec(base), tmp_path_factory.mktemp("q-whole") / "tiny",
                                 until="quantize")
    art, folder = split.artifacts["quantize"].artifact, split.artifacts["quantize"].folder
    assert {"rank0/model.onnx", "rank1/model.onnx"} <= set(art.files)
    graphs = [folder / f"rank{r}" / art.onnx for r in range(2)]
    whole_graph = whole.artifacts["quantize"].folder / whole.artifacts["quantize"].artifact.onnx
    for graph in graphs:  # every projection and the LM head's slice in 4 bits; the collectives kept
        ops = _ops(graph)
        assert ops.count("MatMulNBits") == _ops(whole_graph).count("MatMulNBits") == 4 * 2 + 1  # qkv, o, gate_up, down
        assert ops.count("AllReduce") == 4 and ops.count("AllGather") == 1

    prompt = [5, 17, 99, 3, 42, 42, 7]
    runner = TensorParallelRunner(graphs, art.kv_layout, num_blocks=8, max_num_tokens=64, num_threads=1)
    try:
        split_tokens, split_logits = _greedy(runner, prompt, 12)
    finally:
        runner.close()
    one = PagedRunner(whole_graph, whole.artifacts["quantize"].artifact.kv_layout, num_blocks=8, max_num_tokens=64,
                      num_threads=1)
    whole_tokens, whole_logits = _greedy(one, prompt, 12)
    one.close()
    np.testing.assert_allclose(split_logits, whole_logits, atol=1e-4)
    assert split_tokens == whole_tokens and len(set(split_tokens)) > 1

    ours, theirs = art.report, whole.artifacts["quantize"].artifact.report  # the report measures the whole function
    assert ours.perplexity_reference == pytest.approx(theirs.perplexity_reference, rel=1e-4)
    assert ours.perplexity_quantized == pytest.approx(theirs.perplexity_quantized, rel=1e-3)
    assert ours.token_agreement == theirs.token_agreement
    assert ours.size_quantized_mib > theirs.size_quantized_mib  # both ranks' files (the embeddings replicated)


def test_awq_calibrates_through_the_ranks_and_the_split_int4_model_serves(tiny_checkpoints, tmp_path_factory):
    from llmc.runtime.serving.loop import ServingLoop
    from serving_rig import RecordingSink, request_inputs

    spec = parse_spec({"name": "tiny", "source": str(tiny_checkpoints["llama"]), "parallel": {"tensor": 2},
                       "quantization": {"mode": "int4-weight-only"}, **TINY_SERVING_SPEC})
    result = build_reusing_export(tmp_path_factory, spec, tmp_path_factory.mktemp("q-awq") / "tiny")
    art = result.artifacts["quantize"].artifact
    assert "awq" in art.method.lower() and art.report.token_agreement > 0.5, art
    loop = ServingLoop.from_manifest(result.repository / "tiny" / "1").start()
    try:
        sink = RecordingSink()
        loop.submit(request_inputs(max_tokens=12), sink)
        tokens = sink.joined("output_ids").tolist()
    finally:
        loop.stop()
    assert len(tokens) == 12 and len(set(tokens)) > 1


def _worker() -> tuple[subprocess.Popen, multiprocessing.connection.Connection, socket.socket]:
    """A stand-in rank process and the supervisor's end of its socket; the test speaks for the rank at the other."""
    ours, theirs = socket.socketpair()
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    return process, multiprocessing.connection.Connection(ours.detach()), theirs


def test_the_first_rank_to_fail_aborts_the_group_and_is_named():
    progress = []
    with Group.create(2) as group:
        workers = [_worker(), _worker()]
        try:
            rank0 = multiprocessing.connection.Connection(workers[0][2].detach())
            rank1 = multiprocessing.connection.Connection(workers[1][2].detach())
            rank0.send(("progress", 1, 4))
            rank1.send(("error", "rank 1 failed: MemoryError: "))
            rank0.send(("error", "rank 0 failed: RuntimeError: the group was aborted"))  # an echo, not the cause
            with pytest.raises(QuantizationError, match=r"parallel.tensor: 2\): rank 1 failed: MemoryError"):
                _supervise([w[:2] for w in workers], group, lambda done, total: progress.append((done, total)))
            assert group.aborted_reason().startswith("rank 1 failed") and progress == [(1, 4)]
        finally:
            for process, *_ in workers:
                process.kill()
                process.wait()


def test_a_rank_process_that_dies_silently_fails_the_build_with_its_exit_code():
    with Group.create(2) as group:
        workers = [_worker(), _worker()]
        try:
            multiprocessing.connection.Connection(workers[0][2].detach()).send(("done",))
            workers[1][2].close()  # the rank's end closes as its process dies
            workers[1][0].kill()
            with pytest.raises(QuantizationError, match=r"rank 1 \(pid \d+\) exited with code -9"):
                _supervise([w[:2] for w in workers], group, None)
        finally:
            for process, *_ in workers:
                process.kill()
                process.wait()
