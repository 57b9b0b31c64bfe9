"""The token-budget scheduler over the paged KV cache (runtime/engine/token_scheduler.py): decode rows mixed with
prompt chunks within the token budget, the prompt cap, bounded rows and queue, and preemption by recompute when the
pool is full. The block manager's own bookkeeping: test_block_manager.py."""

import pytest

from llmc.runtime.decoding.sampling import SamplingParams
from llmc.runtime.engine.block_manager import BlockManager
from llmc.runtime.engine.core import QueueFull
from llmc.runtime.engine.sequence import Sequence, Status
from llmc.runtime.engine.token_scheduler import TokenScheduler


def seq(prompt, request_id="r", max_tokens=64):
    return Sequence(request_id, list(prompt), SamplingParams(max_tokens=max_tokens))


def computed(s):  # the graph wrote every token of s
    s.num_cached = s.num_tokens


def test_steps_mix_decode_rows_with_prompt_chunks_within_the_token_budget():
    sched = TokenScheduler(BlockManager(64, 4), max_rows=8, max_num_tokens=16, max_queue_size=8, capacity=1024)
    decoders = [seq(range(5), f"d{i}") for i in range(3)]
    for d in decoders:
        sched.add(d)
    for chunk in sched.schedule():  # 15 prompt tokens fit the budget: all three prefill at once
        sched.computed(chunk)
        assert chunk.samples
        chunk.seq.output_ids.append(7)
        chunk.seq.status = Status.decoding
    long = seq(range(100, 140), "long")
    sched.add(long)
    chunks = sched.schedule()
    assert [(c.seq.request_id, len(c.token_ids)) for c in chunks] == [("d0", 1), ("d1", 1), ("d2", 1), ("long", 13)]
    assert not chunks[-1].samples and chunks[0].samples and chunks[0].past_len == 5
    for chunk in chunks:
        sched.computed(chunk)
        if chunk.samples:
            chunk.seq.output_ids.append(8)
    chunks = sched.schedule()
    assert [c.past_len for c in chunks] == [6, 6, 6, 13] and len(chunks[-1].token_ids) == 13

def test_the_prompt_cap_is_asked_only_when_a_prompt_competes_for_the_step():
    """The step-cost fit is a least-squares solve (~0.3 ms): a step of decode rows alone, batch-1 decode's
    every step, has no prompt token to cap and does not ask for it."""
    sched = TokenScheduler(BlockManager(64, 4), max_rows=4, max_num_tokens=16, max_queue_size=4, capacity=1024)
    asked = []
    cap = lambda rows: asked.append(rows) or 4  # noqa: E731
    first = seq(range(6), "a")
    sched.add(first)
    [chunk] = sched.schedule(cap)  # a prompt and no decode row: asked (with 0 rows), and the cap holds
    assert asked == [0] and len(chunk.token_ids) == 4
    sched.computed(chunk)
    [chunk] = sched.schedule(cap)
    sched.computed(chunk)
    first.output_ids.append(7)
    first.status = Status.decoding
    asked.clear()
    for _ in range(3):  # decode rows alone
        [chunk] = sched.schedule(cap)
        sched.computed(chunk)
        first.output_ids.append(7)
    assert asked == []
    sched.add(seq(range(50, 60), "b"))
    chunks = sched.schedule(cap)  # a prompt joins the decode row: asked with 1 row, its chunk capped
    assert asked == [1] and [len(c.token_ids) for c in chunks] == [1, 4]

def test_rows_and_queue_are_bounded():
    sched = TokenScheduler(BlockManager(64, 4), max_rows=2, max_num_tokens=64, max_queue_size=3, capacity=1024)
    for i in range(3):
        sched.add(seq([1, 2, 3], f"r{i}"))
    with pytest.raises(QueueFull):
        sched.add(seq([1], "late"))
    assert len(sched.schedule()) == 2 and sched.num_waiting == 1 and sched.num_running == 2

def test_a_full_pool_queues_and_preempts_the_newest_which_recomputes():
    sched = TokenScheduler(BlockManager(4, 4), max_rows=4, max_num_tokens=64, max_queue_size=8, capacity=1024)
    old, new = seq(range(8), "old"), seq(range(50, 57), "new")
    sched.add(old)
    sched.add(new)
    for chunk in sched.schedule():  # 2 + 2 blocks: the pool is full
        sched.computed(chunk)
        chunk.seq.output_ids.append(1)
        chunk.seq.status = Status.decoding
    sched.add(seq([5], "queued"))
    chunks = sched.schedule()  # old's 9th token needs a fifth block: new is preempted, queued waits
    assert [c.seq.request_id for c in chunks] == ["old"] and sched.num_preemptions == 1
    assert new.status is Status.waiting and sched.waiting[0] is new and new.block_ids == []
    assert all(len(c.seq.block_ids) * 4 >= c.past_len + len(c.token_ids) for c in chunks)
