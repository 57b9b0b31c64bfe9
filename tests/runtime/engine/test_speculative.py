"""Speculative decoding in the paged engine (runtime/engine/speculative.py, ngram.py) on a real paged graph:
greedy and seeded sampled outputs with speculation on equal those with it off, token for token, at
batch 1 and under concurrent load (with preemption and prefix caching in play); the rejection rule's
first token follows the target's softmax (a fixed-seed total-variation bound on synthetic logits);
rejected proposals give their blocks back and are never committed to the prefix cache."""

import numpy as np
import pytest

from llmc.compiler import build
from llmc.compiler.spec import parse_spec
from llmc.runtime.engine.block_manager import BlockManager, block_hash
from llmc.runtime.manifest import SpeculativeConfig
from llmc.runtime.engine.ngram import NgramProposer
from llmc.runtime.engine.paged_engine import PagedEngine
from llmc.runtime.runners.paged import PagedRunner
from llmc.runtime.decoding.sampling import SamplingParams
from llmc.runtime.engine.sequence import Sequence, Status
from llmc.runtime.engine.speculative import Speculator, verify
from llmc.runtime.engine.step_plan import Chunk
from llmc.runtime.engine.token_scheduler import TokenScheduler

rng = np.random.default_rng(11)
PASSAGE = rng.integers(0, 256, 24).tolist()
# prompts whose continuations the prompt itself predicts (a passage repeated: the model copies it),
# and plain random ones
PROMPTS = {"copy0": PASSAGE * 3, "copy1": rng.integers(0, 256, 5).tolist() + PASSAGE * 2 + PASSAGE[:7],
           "copy2": (PASSAGE[:12] * 4)[:-3], "rand0": rng.integers(0, 256, 19).tolist(), "rand1": [9, 8]}
TOKENS = 24
SPEC = SpeculativeConfig(method="ngram", num_tokens=4, max_batch=4, min_n=1, max_n=3)


def _export(tiny_checkpoints, tmp_path_factory, family: str, kv_cache_dtype: str = "fp32"):
    spec = parse_spec({"name": "t", "source": str(tiny_checkpoints[family]),
                       "export": {"attention": "paged", "kv_cache_dtype": kv_cache_dtype}})
    folder = tmp_path_factory.mktemp(f"speculative-{family}-{kv_cache_dtype}") / "t"
    return folder / "export", build(spec, output=folder, until="export").exported


@pytest.fixture(scope="module")
def paged(tiny_checkpoints, tmp_path_factory):
    return _export(tiny_checkpoints, tmp_path_factory, "llama")


def _engine(paged, speculative=SPEC, *, num_blocks=64, max_rows=8, max_num_tokens=48, prefix_caching=True):
    folder, exported = paged
    runner = PagedRunner(folder / exported.onnx, exported.kv_layout, num_blocks=num_blocks,
                         max_num_tokens=max_num_tokens, num_threads=1)
    return PagedEngine(runner, max_rows=max_rows, max_seq_len=128, max_num_tokens=max_num_tokens,
                       prefix_caching=prefix_caching, speculative=speculative)


def _run(engine, requests: dict[str, SamplingParams], logprobs=False):
    for name, params in requests.items():
        engine.add_request(name, PROMPTS[name.split(":")[0]], params, logprobs=2 if logprobs else None)
    tokens = {name: [] for name in requests}
    values = {name: [] for name in requests} if logprobs else {}
    while engine.has_work:
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
            if logprobs:
                assert len(out.logprobs) == len(out.token_ids)
                values[out.request_id] += out.logprobs.values.tolist()
    return tokens, values


GREEDY = SamplingParams(max_tokens=TOKENS)


@pytest.fixture(scope="module")
def plain(paged):
    return {name: _run(_engine(paged, None), {name: GREEDY})[0][name] for name in PROMPTS}


def test_greedy_with_speculation_at_batch_1_equals_without(paged, plain):
    engine = _engine(paged)
    for name in PROMPTS:
        assert _run(engine, {name: GREEDY})[0][name] == plain[name], name
    spec = engine.speculator
    assert spec.num_draft_tokens > 0 and 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    assert engine.blocks.num_used == 0


def test_greedy_with_speculation_under_concurrent_load_equals_without(paged, plain):
    engine = _engine(paged, max_rows=6)
    tokens, _ = _run(engine, {name: GREEDY for name in PROMPTS})
    assert tokens == plain
    assert engine.speculator.num_accepted_tokens > 0 and engine.blocks.num_used == 0


@pytest.mark.parametrize("family, kv_cache_dtype", [("qwen2", "fp32"), ("gpt2", "fp32"), ("llama", "int8")])
def test_greedy_with_speculation_equals_without_on_other_families_and_caches(tiny_checkpoints, tmp_path_factory,
                                                                              family, kv_cache_dtype):
    paged = _export(tiny_checkpoints, tmp_path_factory, family, kv_cache_dtype)
    plain = {name: _run(_engine(paged, None), {name: GREEDY})[0][name] for name in PROMPTS}
    engine = _engine(paged, max_rows=6)
    assert _run(engine, {name: GREEDY for name in PROMPTS})[0] == plain
    assert engine.speculator.num_accepted_tokens > 0


def test_speculation_with_preemption_and_no_prefix_cache_changes_nothing(paged, plain):
    engine = _engine(paged, num_blocks=9, max_rows=4, prefix_caching=False)  # 9 blocks of 16: too few for all
    names = ["copy0", "copy1", "copy2", "rand0"]
    assert _run(engine, {n: GREEDY for n in names})[0] == {n: plain[n] for n in names}
    assert engine.scheduler.num_preemptions > 0 and engine.speculator.num_accepted_tokens > 0


def test_rows_beyond_max_batch_decode_normally(paged, plain):
    one = SpeculativeConfig(method="ngram", num_tokens=3, max_batch=1, min_n=2, max_n=2)
    engine = _engine(paged, one)
    seen = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda cap=None: seen.append(chunks := schedule(cap)) or chunks
    assert _run(engine, {n: GREEDY for n in ("copy0", "copy1", "copy2")})[0] == \
        {n: plain[n] for n in ("copy0", "copy1", "copy2")}
    assert max(sum(bool(c.proposals) for c in chunks) for chunks in seen) == 1
    assert max(len(c.proposals) for chunks in seen for c in chunks) == 3


def test_no_row_speculates_while_more_requests_than_disable_batch_size_are_in(paged, plain):
    names = ("copy0", "copy1", "copy2")
    for limit in (2, 3):
        spec = SpeculativeConfig(method="ngram", num_tokens=3, max_batch=2, min_n=2, max_n=2, disable_batch_size=limit)
        engine = _engine(paged, spec)
        scheduler, seen = engine.scheduler, []
        schedule = scheduler.schedule
        engine.scheduler.schedule = lambda cap=None: seen.append(
            (len(scheduler.running) + len(scheduler.waiting), chunks := schedule(cap))) or chunks
        assert _run(engine, {n: GREEDY for n in names})[0] == {n: plain[n] for n in names}
        speculated = [n for n, chunks in seen if any(c.proposals for c in chunks)]
        assert speculated and max(speculated) <= limit, (limit, speculated)
    unset = SpeculativeConfig(method="ngram", num_tokens=3, max_batch=4, min_n=2, max_n=2)
    assert Speculator.from_config(unset, 128).disable_batch_size >= 1024  # unset, prompt lookup: never


# every sampling knob the plain sampler has, each request seeded: the same tokens with speculation on or
# off. Low temperatures: the random tiny model repeats itself there, so proposals get accepted
SAMPLED = {"copy0:a": SamplingParams(max_tokens=TOKENS, temperature=0.05, seed=1),
           "copy1:b": SamplingParams(max_tokens=TOKENS, temperature=0.2, top_k=5, top_p=0.9, seed=2),
           "copy2:c": SamplingParams(max_tokens=TOKENS, temperature=0.1, min_p=0.1, repetition_penalty=1.05,
                                     frequency_penalty=0.1, presence_penalty=0.1, seed=3),
           "copy0:d": SamplingParams(max_tokens=TOKENS, temperature=0.1, repetition_penalty=1.2, min_tokens=5,
                                     end_ids=(7,), seed=5),
           "rand0:e": SamplingParams(max_tokens=TOKENS, temperature=0.05, seed=4)}


def test_seeded_sampling_and_logprobs_with_speculation_equal_without(paged):
    expected = _run(_engine(paged, None), SAMPLED, logprobs=True)
    engine = _engine(paged)
    got = _run(engine, SAMPLED, logprobs=True)
    assert got[0] == expected[0]
    assert got[1].keys() == expected[1].keys()
    for name in expected[1]:
        np.testing.assert_allclose(got[1][name], expected[1][name], atol=1e-4, err_msg=name)
    assert engine.speculator.num_accepted_tokens > 0


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
    scheduler = TokenScheduler(blocks, max_rows=2, max_num_tokens=16, max_queue_size=4)
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
    scheduler = TokenScheduler(blocks, max_rows=2, max_num_tokens=16, max_queue_size=4,
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


def test_a_stop_word_inside_accepted_proposals_ends_the_request_where_it_would_without(paged):
    from conftest import byte_tokenizer

    def run(speculative, stop_words=()):
        folder, exported = paged
        runner = PagedRunner(folder / exported.onnx, exported.kv_layout, num_blocks=64, max_num_tokens=48,
                             num_threads=1)
        engine = PagedEngine(runner, byte_tokenizer(), max_rows=4, max_seq_len=128, max_num_tokens=48,
                             speculative=speculative)
        engine.add_request("r", PROMPTS["copy0"], SamplingParams(max_tokens=TOKENS, stop_words=stop_words))
        ids, text, reason = [], "", None
        while engine.has_work:
            for out in engine.step():
                ids, text, reason = ids + out.token_ids, text + out.text, out.finish_reason or reason
        return ids, text, reason, engine.speculator

    _, whole, _, _ = run(None)
    # the shortest text that first appears in the output's second half (by then proposals are accepted)
    stop = next(whole[i:i + n] for n in range(1, 5) for i in range(len(whole) // 2, len(whole) - n)
                if whole.find(whole[i:i + n]) == i)
    plain = run(None, (stop,))
    spec = run(SPEC, (stop,))
    assert spec[:3] == plain[:3] and plain[2] == "stop" and len(plain[1]) < len(whole)
    assert spec[3].num_accepted_tokens > 0


def test_at_most_max_batch_rows_speculate_the_oldest_that_have_proposals():
    blocks = BlockManager(num_blocks=16, block_size=4)
    spec = SpeculativeConfig(method="ngram", num_tokens=2, max_batch=1, min_n=2, max_n=2)
    scheduler = TokenScheduler(blocks, max_rows=3, max_num_tokens=16, max_queue_size=4,
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
    scheduler = TokenScheduler(blocks, max_rows=2, max_num_tokens=16, max_queue_size=4,
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
