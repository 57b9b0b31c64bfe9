"""The paged KV cache's bookkeeping (runtime/engine/block_manager.py): reference counts, prefix reuse, LRU eviction,
key collisions, LongRoPE's keys, and the invariants of it and the scheduler over it (test_token_scheduler.py) under
random load."""

from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st

from llmc.runtime.engine import block_manager
from llmc.runtime.engine.block_manager import BlockManager
from llmc.runtime.decoding.sampling import SamplingParams
from llmc.runtime.engine.sequence import Sequence, Status
from llmc.runtime.engine.token_scheduler import TokenScheduler


def seq(prompt, request_id="r", max_tokens=64):
    return Sequence(request_id, list(prompt), SamplingParams(max_tokens=max_tokens))


def computed(s):  # the graph wrote every token of s
    s.num_cached = s.num_tokens


def test_blocks_are_counted_and_given_back():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(range(10))
    assert bm.can_allocate(a)
    bm.allocate(a)
    assert len(a.block_ids) == 3 and a.num_cached == 0 and (bm.num_used, bm.num_free) == (3, 5)
    a.output_ids += [1, 2]  # 12 tokens: still 3 blocks
    bm.append(a)
    assert len(a.block_ids) == 3
    a.output_ids.append(3)  # the 13th token starts a block
    assert bm.can_append(a)
    bm.append(a)
    assert len(a.block_ids) == 4 and len(set(a.block_ids)) == 4
    bm.free(a)
    assert (bm.num_used, bm.num_free, a.block_ids, a.num_cached) == (0, 8, [], 0)


def test_a_cached_prefix_is_shared_and_the_last_prompt_token_is_always_computed():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13])
    bm.allocate(a)
    computed(a)
    bm.commit(a)  # three full blocks keyed
    b = seq([1, 2, 3, 4, 5, 6, 7, 8, 99, 98])
    bm.allocate(b)
    assert b.block_ids[:2] == a.block_ids[:2] and b.num_cached == 8 and b.block_ids[2] not in a.block_ids
    assert [bm.ref_counts[x] for x in a.block_ids[:3]] == [2, 2, 1]
    c = seq([1, 2, 3, 4, 5, 6, 7, 8])  # the whole prompt is cached, but its last token needs logits
    bm.allocate(c)
    assert c.num_cached == 4 and c.block_ids[0] == a.block_ids[0] and c.block_ids[1] != a.block_ids[1]
    assert (bm.prefix_queries, bm.prefix_hits) == (13 + 10 + 8, 0 + 8 + 4)
    bm.free(a)
    assert bm.ref_counts[a.block_ids[0] if a.block_ids else b.block_ids[0]] == 2  # b and c still hold it


def test_released_prefixes_stay_reusable_until_the_pool_needs_them_lru_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    first, second = seq([1, 2, 3]), seq([5, 6, 7])
    for s in (first, second):
        bm.allocate(s)
        computed(s)
        bm.commit(s)
    kept = {tuple(s.prompt_ids): s.block_ids[0] for s in (first, second)}
    bm.free(first)
    bm.free(second)
    assert (bm.num_cached, bm.num_free) == (2, 2)
    again = seq([5, 6, 0])
    bm.allocate(again)
    assert again.block_ids[0] == kept[(5, 6, 7)] and again.num_cached == 2
    big = seq([9, 9, 9, 9])  # needs 2 blocks: the last free one, then the oldest cached one (first's)
    bm.allocate(big)
    assert kept[(1, 2, 3)] in big.block_ids and bm.num_cached == 0
    assert not bm.can_allocate(seq([1, 2, 3]))  # its prefix was evicted and the pool is full
    bm.free(big)
    probe = seq([1, 2, 3])
    bm.allocate(probe)
    assert probe.num_cached == 0  # evicted keys are gone


def test_a_key_collision_shares_no_kv(monkeypatch):
    """Every block gets the same key: a hit still needs the block's own tokens, computed after the
    sequence's own previous block (not equal tokens at another position)."""
    monkeypatch.setattr(block_manager, "block_hash", lambda previous, tokens: b"same")
    bm = BlockManager(num_blocks=16, block_size=4)
    a = seq([1, 2, 3, 4, 5])
    bm.allocate(a)
    computed(a)
    bm.commit(a)  # a's first block holds the key
    other = seq([9, 9, 9, 9, 5])
    bm.allocate(other)
    assert other.num_cached == 0 and a.block_ids[0] not in other.block_ids
    repeated = seq([1, 2, 3, 4, 1, 2, 3, 4, 0])  # its second block has a's first block's tokens, at 4..7
    bm.allocate(repeated)
    assert repeated.num_cached == 4 and repeated.block_ids[0] == a.block_ids[0]
    assert repeated.block_ids[1] != a.block_ids[0]
    assert (bm.ref_counts[a.block_ids[0]], bm.prefix_hits) == (2, 4)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 2), min_size=1, max_size=10), st.booleans()), min_size=2,
                max_size=14))
def test_hits_hold_exactly_the_prefix_when_keys_collide(requests):
    """Keys from few buckets (most unequal prefixes collide), prompts from three token ids (many equal
    prefixes): every block a sequence gets as cached holds the KV of its own tokens at their positions."""
    kv = {}  # (block, offset) -> the tokens up to and including the one whose KV is written there
    held = []
    with mock.patch.object(block_manager, "block_hash", lambda previous, tokens: bytes([sum(tokens) % 3])):
        bm = BlockManager(num_blocks=8, block_size=2)
        for prompt, keep in requests:
            s = seq(prompt)
            if not bm.can_allocate(s):
                for h in held:
                    bm.free(h)
                held = []
            bm.allocate(s)
            tokens = s.all_token_ids()
            for p in range(s.num_tokens):
                where = (s.block_ids[p // 2], p % 2)
                if p < s.num_cached:
                    assert kv[where] == tuple(tokens[:p + 1])
                else:
                    kv[where] = tuple(tokens[:p + 1])
            computed(s)
            bm.commit(s)
            if keep:
                held.append(s)
            else:
                bm.free(s)


def test_a_prefix_two_rows_computed_at_once_still_chains():
    """Both rows computed [1, 2, 3, 4] before either was keyed: the first keys it, and the second's own
    next block is keyed after the first's, so a prompt of the second's prefix finds both."""
    bm = BlockManager(num_blocks=16, block_size=4)
    a, b = seq([1, 2, 3, 4, 5, 6, 7, 8, 0]), seq([1, 2, 3, 4, 9, 9, 9, 9, 0])
    for s in (a, b):
        bm.allocate(s)
    for s in (a, b):
        computed(s)
        bm.commit(s)
    assert bm.keys[b.block_ids[0]] is None and bm.keys[b.block_ids[1]] is not None
    c = seq([1, 2, 3, 4, 9, 9, 9, 9, 1])
    bm.allocate(c)
    assert c.num_cached == 8 and c.block_ids[:2] == [a.block_ids[0], b.block_ids[1]]


def test_prefix_caching_off_shares_nothing():
    bm = BlockManager(num_blocks=8, block_size=2, prefix_caching=False)
    a = seq([1, 2, 3, 4, 5])
    bm.allocate(a)
    computed(a)
    bm.commit(a)
    bm.free(a)
    b = seq([1, 2, 3, 4, 5])
    bm.allocate(b)
    assert b.num_cached == 0 and bm.num_cached == 0 and bm.prefix_queries == 0


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(0, 3)), min_size=1, max_size=12),
       st.integers(4, 24), st.sampled_from([1, 4, 8]), st.booleans())
def test_random_load_keeps_the_invariants(requests, num_blocks, block_size, caching):
    bm = BlockManager(num_blocks, block_size, caching)
    sched = TokenScheduler(bm, max_rows=4, max_num_tokens=32, max_queue_size=64, capacity=1024)
    seqs = []
    for i, (length, max_tokens, family) in enumerate(requests):
        if bm.blocks_for(length + max_tokens) > num_blocks:
            continue  # the engine refuses what can never fit
        s = seq([family] * (length // 2) + list(range(length - length // 2)), f"r{i}", max_tokens)
        seqs.append(s)
        sched.add(s)
    for _ in range(2000):
        if not sched.running and not sched.waiting:
            break
        chunks = sched.schedule()
        assert chunks or not sched.running, "running sequences but nothing scheduled"
        assert sum(len(c.token_ids) for c in chunks) <= 32 and len(chunks) <= 4
        holders = [b for s in sched.running for b in s.block_ids]
        assert all(bm.ref_counts[b] == holders.count(b) for b in set(holders))
        assert bm.num_used == len(set(holders))
        for c in chunks:
            assert len(c.seq.block_ids) * block_size >= c.past_len + len(c.token_ids)
            sched.computed(c)
            if c.samples:
                c.seq.output_ids.append(len(c.seq.output_ids))
                c.seq.status = Status.decoding
                if len(c.seq.output_ids) >= c.seq.params.max_tokens:
                    c.seq.status = Status.finished
                    sched.release(c.seq)
    assert not sched.running and not sched.waiting
    assert all(len(s.output_ids) == s.params.max_tokens for s in seqs) and bm.num_used == 0


def test_longrope_blocks_are_keyed_by_the_table_their_kv_took():
    """A LongRoPE model (switch at 8 tokens): a short prompt's blocks never serve a long prompt with the
    same start (its KV took the short factors), a long prompt's serve a later long one; another
    model's keys are as they were."""
    bm = BlockManager(num_blocks=16, block_size=4, longrope_switch=8)
    short, long, again = seq(range(8), "s"), seq(range(12), "l"), seq(range(12), "a")
    bm.allocate(short)
    assert not short.long_rope
    computed(short)
    bm.commit(short)
    bm.free(short)
    assert bm.num_cached == 2  # its two full blocks, keyed
    assert bm.can_allocate(long)
    bm.allocate(long)
    assert long.long_rope and long.num_cached == 0  # a different chain: no hit
    computed(long)
    bm.commit(long)
    bm.allocate(again)
    assert again.long_rope and again.num_cached == 8 and again.block_ids[:2] == long.block_ids[:2]
    plain = BlockManager(num_blocks=4, block_size=4)
    first = seq(range(8))
    plain.allocate(first)
    computed(first)
    plain.commit(first)
    assert plain.keys[first.block_ids[0]] == block_manager.block_hash(None, [0, 1, 2, 3])


def test_a_longrope_sequence_growing_past_the_switch_recomputes_unpreempted():
    """It gives its blocks back and prefills prompt and output again, with the long factors, in the
    same step (runtime/engine/longrope.py)."""
    bm = BlockManager(num_blocks=16, block_size=4, longrope_switch=8)
    scheduler = TokenScheduler(bm, max_rows=2, max_num_tokens=16, max_queue_size=4, capacity=1024)
    s = seq(range(6))
    scheduler.add(s)
    plan = scheduler.schedule()
    assert [c.token_ids for c in plan] == [list(range(6))] and not s.long_rope
    for i, token in enumerate((6, 7, 8)):  # the graph wrote what was fed; then a token is sampled
        scheduler.computed(plan[0])
        s.status = Status.decoding
        s.output_ids.append(token)
        plan = scheduler.schedule()
        if i < 2:  # 7, then 8 tokens: it decodes on its short-factor KV
            assert [(c.token_ids, c.past_len) for c in plan] == [([token], 6 + i)]
    assert [(c.token_ids, c.past_len) for c in plan] == [(list(range(9)), 0)]  # 9 tokens: all again, long
    assert s.long_rope and s.status is Status.prefilling and scheduler.num_preemptions == 0
