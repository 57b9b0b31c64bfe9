"""OrtRunner: the fused graph updates the KV slots in place; capacity and slot choice do not change results."""

import numpy as np
import pytest

from shared_builds import build_reusing_export
from llmc.compiler.spec import parse_spec
from llmc.runtime.runners.ort import OrtRunner
from llmc.runtime.runners.protocol import Runner, RunnerClosed


@pytest.fixture(scope="module")
def exports(tiny_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("runner")
    out = {}
    for attention in ("fused", "reference"):
        spec = parse_spec({"name": "t", "source": str(tiny_checkpoints["llama"]), "export": {"attention": attention}})
        exported = build_reusing_export(tmp_path_factory, spec, root / attention, until="export").exported
        out[attention] = (root / attention / "export" / exported.onnx, exported.kv_layout)
    return out


def _runner(exports, attention, max_batch=2, capacity=64):
    path, layout = exports[attention]
    return OrtRunner(path, layout, max_batch=max_batch, capacity=capacity, num_threads=1)


def test_fused_step_writes_only_the_new_entries_in_place(exports):
    runner = _runner(exports, "fused")
    buffers = list(runner.cache.buffers)
    for b in buffers:
        b[...] = 7.0  # stale data from an earlier occupant must be overwritten only where written
    runner.step(np.array([[1, 2, 3]]), np.array([0]), first_row=1)
    runner.step(np.array([[4]]), np.array([3]), first_row=1)
    assert all(a is b for a, b in zip(runner.cache.buffers, buffers))  # no reallocation, no swap
    k0 = buffers[0]
    assert (k0[0] == 7.0).all()  # the other slot is untouched
    assert (k0[1, :, :4] != 7.0).all() and (k0[1, :, 4:] == 7.0).all()


def test_lowerings_agree_and_capacity_does_not_matter(exports):
    prompt = np.array([[5, 9, 3, 77, 12]])
    results = []
    for attention, capacity in (("fused", 16), ("fused", 512), ("reference", 16), ("reference", 64)):
        runner = _runner(exports, attention, capacity=capacity)
        logits = [runner.step(prompt, np.array([0]))[0, -1]]
        for pos in range(5, 9):
            logits.append(runner.step(np.array([[int(logits[-1].argmax())]]), np.array([pos]))[0, -1])
        results.append(np.stack(logits))
    for other in results[1:]:
        np.testing.assert_allclose(other, results[0], atol=2e-5, rtol=1e-5)


def test_rows_decode_side_by_side_as_they_do_alone(exports):
    runner, solo = _runner(exports, "fused"), _runner(exports, "fused", max_batch=1)
    prompts = [[3, 1, 4, 1, 5, 9, 2], [6, 5]]
    for row, p in enumerate(prompts):
        runner.step(np.array([p]), np.array([0]), first_row=row)
    together = runner.step(np.array([[8], [8]]), np.array([7, 2]))[:, -1]
    for row, p in enumerate(prompts):
        solo.step(np.array([p]), np.array([0]))
        alone = solo.step(np.array([[8]]), np.array([len(p)]))[0, -1]
        np.testing.assert_allclose(together[row], alone, atol=2e-5, rtol=1e-5)


def test_bad_steps_are_refused(exports):
    runner = _runner(exports, "fused", capacity=8)
    with pytest.raises(ValueError, match="overflow"):
        runner.step(np.array([[1, 2, 3]]), np.array([6]))
    with pytest.raises(ValueError, match="at most 1 row"):
        runner.step(np.array([[1, 2], [3, 4]]), np.array([0, 0]))
    with pytest.raises(ValueError, match="outside the cache"):
        runner.step(np.array([[1]]), np.array([0]), first_row=2)
    with pytest.raises(ValueError, match="one per row"):
        runner.step(np.array([[1], [2]]), np.array([0]))


def test_decode_steps_on_any_row_range_match_prefill_and_return_the_callers_logits(exports):
    """Decode steps run on bindings made once per row range, inputs and logits in shared buffers:
    every range must see its own tokens and positions, and logits handed out must not change later."""
    runner, solo = _runner(exports, "fused", max_batch=3), _runner(exports, "fused", max_batch=1)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7]]
    for row, p in enumerate(prompts):
        runner.step(np.array([p]), np.array([0]), first_row=row)
    fed = [list(p) for p in prompts]
    kept = []
    for first, tokens in ((1, [8, 9]), (0, [7, 7, 7]), (0, [11]), (1, [12, 13]), (2, [14])):
        rows = range(first, first + len(tokens))
        positions = np.array([len(fed[r]) for r in rows], dtype=np.int32)  # any integer type, converted
        logits = runner.step(np.array(tokens)[:, None], positions, first_row=first)
        assert logits.shape == (len(tokens), 1, runner.vocab_size)
        kept.append((logits, logits.copy()))
        for r, token, row_logits in zip(rows, tokens, logits[:, -1]):
            fed[r].append(token)
            alone = solo.step(np.array([fed[r]]), np.array([0]))[0, -1]  # the prefill path, fresh bindings
            np.testing.assert_allclose(row_logits, alone, atol=2e-5, rtol=1e-5)
    assert len(runner._decode_bindings) == 4  # (1, 2), (0, 3), (0, 1), (2, 1): made once each
    for logits, copy in kept:
        np.testing.assert_array_equal(logits, copy)


def test_ort_runner_is_a_runner_and_close_ends_it(exports):
    runner = _runner(exports, "fused", max_batch=3, capacity=32)
    assert isinstance(runner, Runner) and (runner.rows, runner.capacity) == (3, 32)
    assert runner.step(np.array([[1, 2]]), np.array([0]), first_row=2).shape == (1, 2, runner.vocab_size)
    runner.close()
    runner.close()  # a second close does nothing
    with pytest.raises(RunnerClosed):
        runner.step(np.array([[3]]), np.array([2]), first_row=2)
