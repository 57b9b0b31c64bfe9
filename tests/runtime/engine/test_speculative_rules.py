"""Speculative decoding's rules without a model (runtime/engine/speculation/speculator.py, ngram.py,
token_scheduler.py, step_plan.py): the rejection rule's first token follows the target's softmax (a
fixed-seed total-variation bound on synthetic logits), the greedy rule, prompt lookup against a brute
force search, and the blocks proposals take: given back when rejected, never committed, never a
decode row's, at most max_batch rows speculating."""

import numpy as np
import pytest

from llmc.runtime.decoding.sampling import SamplingParams
from llmc.runtime.engine.block_manager import BlockManager
from llmc.runtime.engine.prefix_keys import block_hash
from llmc.runtime.engine.speculation.ngram import NgramProposer
from llmc.runtime.engine.sequence import Sequence, Status
from llmc.runtime.engine.speculation.speculator import Speculator, verify
from llmc.runtime.engine.step_plan import Chunk
from llmc.runtime.engine.token_scheduler import TokenScheduler
from llmc.runtime.manifest import SpeculativeConfig

SPEC = SpeculativeConfig(method="ngram", num_tokens=4, max_batch=4, min_n=1, max_n=3)


def _target(logits: np.ndarray, temperature: float, top_k: int) -> np.ndarray:
    """The plain sampler's distribution, written out: softmax at `temperature` over the top_k logits."""
    keep = np.argsort(-logits)[:top_k]
    p = np.zeros_like(logits, dtype=np.float64)
    p[keep] = np.exp((logits[keep] - logits[keep].max()) / temperature)
    return p / p.sum()


@pytest.mark.parametrize("proposed", [1, 4], ids=["likely-proposal", "unlikely-proposal"])
def test_rejection_rule_first_and_second_tokens_follow_the_target(proposed):
    """20000 seeded rows each propose [proposed, 2] over fixed logits: the first kept token's frequencies
    match the target's distribution at row 0 (total variation < 0.015; sampling noise alone is ~0.005
    here, and a rule that kept proposals too often or too rarely lands far outside), and the token after
    an accepted first proposal follows row 1's."""
    logits = np.array([[2.0, 1.6, 0.3, -0.5, 0.9, -3.0, 0.0, 1.1], [0.1, -1.0, 1.5, 0.7, 0.2, -0.4, 1.4, 0.0],
                       [0.0] * 8], dtype=np.float32)
    params = SamplingParams(max_tokens=8, temperature=0.8, top_k=6)
    n = 20000
    seqs = [Sequence(f"r{i}", [3], params.model_copy(update={"seed": i})) for i in range(n)]
    kept = verify(np.tile(logits, (n, 1)), seqs, [[proposed, 2]] * n)
    first = np.bincount([k[0] for k in kept], minlength=8) / n
    p0, p1 = _target(logits[0], 0.8, 6), _target(logits[1], 0.8, 6)
    assert 0.5 * np.abs(first - p0).sum() < 0.015
    after = [k[1] for k in kept if k[0] == proposed]
    second = np.bincount(after, minlength=8) / len(after)
    assert len(after) > 1000 and 0.5 * np.abs(second - p1).sum() < 0.03
    # a rejection ends the row's tokens; an acceptance goes on to the next proposal, or the bonus token
    assert all(len(k) == 1 for k in kept if k[0] != proposed)
    assert all(len(k) == (3 if k[1] == 2 else 2) for k in kept if k[0] == proposed)


def test_greedy_rule_keeps_the_agreeing_prefix_and_the_targets_next_token():
    logits = np.full((4, 6), -1.0, dtype=np.float32)
    logits[[0, 1, 2, 3], [4, 5, 0, 3]] = 1.0  # the target's argmax after each position: 4, 5, 0, 3
    seq = Sequence("g", [1], SamplingParams(max_tokens=9))
    assert verify(logits, [seq], [[4, 5, 2]]) == [[4, 5, 0]]  # third proposal rejected: the target's 0
    assert verify(logits, [seq], [[4, 5, 0]]) == [[4, 5, 0, 3]]  # all accepted: the bonus token
    assert verify(logits[:1], [seq], [[]]) == [[4]]


def test_ngram_proposes_what_followed_the_latest_longest_match():
    proposer = NgramProposer(num_tokens=3, min_n=1, max_n=3)
    tokens = np.array([5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 5, 6, 7])
    assert proposer.propose(tokens, 10) == [8, 9, 1]  # "5 6 7" (the longest) beats the later "6 7"
    assert proposer.propose(np.array([1, 2, 3, 1, 2, 4, 1, 2]), 10) == [4, 1, 2]  # "1 2" twice: the latest
    assert proposer.propose(np.array([5, 6, 7, 1, 5, 6, 7]), 10) == [1, 5, 6]
    assert proposer.propose(np.array([5, 6, 7, 1, 5, 6, 7]), 2) == [1, 5]
    assert proposer.propose(np.array([1, 2, 3, 4]), 10) == []  # nothing earlier matches
    assert NgramProposer(4, min_n=2, max_n=3).propose(np.array([9, 4, 8, 1, 4]), 10) == []  # 1-grams not tried
    assert proposer.propose(np.array([4, 4]), 10) == [4]
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(4, min_n=3, max_n=2)


def test_ngram_lookup_equals_a_brute_force_search_over_every_window():
    from numpy.lib.stride_tricks import sliding_window_view

    def brute(tokens, k, min_n, max_n, limit):
        for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
            windows = sliding_window_view(tokens[:-1], n)  # each followed by a token
            hits = np.flatnonzero((windows == tokens[len(tokens) - n:]).all(axis=1))
            if hits.size:
                return tokens[hits[-1] + n:hits[-1] + n + min(k, limit)].tolist()
        return []

    draw = np.random.default_rng(1)
    for _ in range(2000):  # short sequences over 4 tokens: many partial and repeated matches
        tokens = draw.integers(0, 4, int(draw.integers(1, 40)))
        min_n = int(draw.integers(1, 4))
        max_n, k, limit = min_n + int(draw.integers(0, 3)), int(draw.integers(1, 6)), int(draw.integers(0, 7))
        assert NgramProposer(k, min_n, max_n).propose(tokens, limit) == brute(tokens, k, min_n, max_n, limit)


def test_rejected_proposals_give_their_blocks_back_and_are_never_committed():
    blocks = BlockManager(num_blocks=8, block_size=4)
    scheduler = TokenScheduler(blocks, max_rows=2, max_num_tokens=16, max_queue_size=4, capacity=1024)
    seq = Sequence("s", [10, 11, 12, 13, 14, 15], SamplingParams(max_tokens=9))
    blocks.allocate(seq)
    seq.num_cached, seq.output_ids = 6, [16]  # decoding: token 16 at position 6 is pending
    blocks.append(seq, extra=4)
    assert len(seq.block_ids) == 3 and blocks.num_free == 5
    chunk = Chunk(seq, [16, 90, 91, 92, 93], 6, [90, 91, 92, 93])
    seq.output_ids.append(17)  # the target rejected 90 and drew 17
    scheduler.computed(chunk, accepted=0)
    assert seq.num_cached == 7 and len(seq.block_ids) == 2 and blocks.num_free == 6
    assert blocks.keys[seq.block_ids[1]] is None  # positions 4..7 hold 90's KV at 7: not a prefix
    first = block_hash(None, [10, 11, 12, 13])
    assert blocks.keys[seq.block_ids[0]] == first
    scheduler.computed(Chunk(seq, [17], 7))  # the next step writes the real token at position 7
    assert blocks.keys[seq.block_ids[1]] == block_hash(first, [14, 15, 16, 17])


def test_speculation_takes_no_block_a_decode_row_needs_and_preempts_no_one():
    blocks = BlockManager(num_blocks=5, block_size=4)
    spec = SpeculativeConfig(method="ngram", num_tokens=3, max_batch=2, min_n=2, max_n=2)
    scheduler = TokenScheduler(blocks, max_rows=2, max_num_tokens=16, max_queue_size=4, capacity=64,
                               speculator=Speculator.from_config(spec, capacity=64))
    a = Sequence("a", [1, 2, 3, 1, 2, 3, 1], SamplingParams(max_tokens=9))  # "1 2" repeats: proposals [3, 1, 2]
    b = Sequence("b", [7, 8, 9, 10, 11, 12, 13, 14], SamplingParams(max_tokens=9))
    for seq, first in ((a, 2), (b, 15)):
        blocks.allocate(seq)
        seq.num_cached, seq.status = len(seq.prompt_ids), Status.decoding
        seq.output_ids.append(first)
        scheduler.running.append(seq)
    # a holds 2 blocks (8 tokens fit), b 2 (its 9th token needs a third): one block is free, and b's
    # own token needs it more than a's proposals do
    chunks = scheduler.schedule()
    assert [c.seq.request_id for c in chunks] == ["a", "b"] and scheduler.num_preemptions == 0
    assert chunks[0].proposals == [] and len(b.block_ids) == 3 and blocks.num_free == 0
    a.output_ids.append(3)  # next step, with a free block again, a speculates
    scheduler.computed(chunks[0])
    blocks.free(b)
    scheduler.running.remove(b)
    chunks = scheduler.schedule()
    assert chunks[0].proposals == [1, 2, 3] and chunks[0].token_ids == [3, 1, 2, 3]


def test_at_most_max_batch_rows_speculate_the_oldest_that_have_proposals():
    blocks = BlockManager(num_blocks=16, block_size=4)
    spec = SpeculativeConfig(method="ngram", num_tokens=2, max_batch=1, min_n=2, max_n=2)
    scheduler = TokenScheduler(blocks, max_rows=3, max_num_tokens=16, max_queue_size=4, capacity=64,
                               speculator=Speculator.from_config(spec, capacity=64))
    prompts = {"none": [1, 2, 3, 4, 5], "first": [5, 6, 7, 5, 6], "second": [8, 9, 8, 9, 8]}  # "none" repeats nothing
    for name, prompt in prompts.items():
        seq = Sequence(name, prompt[:-1], SamplingParams(max_tokens=9))
        blocks.allocate(seq)
        seq.num_cached, seq.status = len(seq.prompt_ids), Status.decoding
        seq.output_ids.append(prompt[-1])
        scheduler.running.append(seq)
    chunks = scheduler.schedule()
    assert [(c.seq.request_id, c.proposals) for c in chunks] == [("none", []), ("first", [7, 5]), ("second", [])]


def test_a_step_plan_takes_a_drafts_proposals_into_its_reservations_and_gives_unused_blocks_back():
    """With a draft model the scheduler reserves blocks; the draft fills the plan through its own
    methods: proposals into a reservation, or the reservation withdrawn and its blocks given back."""
    blocks = BlockManager(num_blocks=8, block_size=4)
    scheduler = TokenScheduler(blocks, max_rows=2, max_num_tokens=16, max_queue_size=4, capacity=64,
                               speculator=Speculator(None, max_batch=2, capacity=64, num_tokens=3))
    for name, prompt in (("a", [1, 2, 3, 4, 5, 6]), ("b", [7, 8, 9, 10, 11, 12])):
        seq = Sequence(name, prompt, SamplingParams(max_tokens=9))
        blocks.allocate(seq)
        seq.num_cached, seq.status = len(prompt), Status.decoding
        seq.output_ids.append(prompt[0])
        scheduler.running.append(seq)
    plan = scheduler.schedule()
    assert plan.reserved == [0, 1] and [c.reserved for c in plan] == [3, 3] and blocks.num_free == 2
    plan.propose(0, [5, 6], None)
    plan.withdraw(1)
    assert plan.reserved == [] and blocks.num_free == 3 and len(plan[1].seq.block_ids) == 2
    assert [(c.token_ids, c.proposals) for c in plan] == [([1, 5, 6], [5, 6]), ([7], [])]
    assert [r.num_logits for r in plan.row_steps()] == [3, 1]


def test_a_short_longrope_sequence_verifies_no_position_past_the_switch():
    """runtime/engine/longrope.py: 13 tokens with the switch at 16 may verify 3 proposals (positions 13-15
    give the logits of sequences of 14-16 tokens); at 16 tokens none; past the switch k again."""
    spec = Speculator.from_config(SPEC, capacity=64, longrope_switch=16)
    for num_tokens, room in ((13, 3), (16, 0), (17, 4), (40, 4)):
        assert spec.limit(Sequence("s", list(range(num_tokens)), SamplingParams(max_tokens=9)), 8) == room, num_tokens
    assert Speculator.from_config(SPEC, capacity=64).limit(Sequence("s", list(range(13)), SamplingParams()), 8) == 4
