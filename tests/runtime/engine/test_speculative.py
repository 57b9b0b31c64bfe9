"""Speculative decoding in the paged engine (runtime/engine/speculation/speculator.py, ngram.py) on a real paged graph:
greedy and seeded sampled outputs with speculation on equal those with it off, token for token, at
batch 1 and under concurrent load (with preemption and prefix caching in play), on other families
and KV cache dtypes, with stop words inside accepted proposals. The rules themselves, without a
model: test_speculative_rules.py."""

import numpy as np
import pytest

from llmc.runtime.manifest import SpeculativeConfig
from llmc.runtime.engine.paged_engine import PagedEngine
from llmc.runtime.runners.paged import PagedRunner
from llmc.runtime.decoding.sampling import SamplingParams
from llmc.runtime.engine.speculation.speculator import Speculator

rng = np.random.default_rng(11)
PASSAGE = rng.integers(0, 256, 24).tolist()
# prompts whose continuations the prompt itself predicts (a passage repeated: the model copies it),
# and plain random ones
PROMPTS = {"copy0": PASSAGE * 3, "copy1": rng.integers(0, 256, 5).tolist() + PASSAGE * 2 + PASSAGE[:7],
           "copy2": (PASSAGE[:12] * 4)[:-3], "rand0": rng.integers(0, 256, 19).tolist(), "rand1": [9, 8]}
TOKENS = 24
SPEC = SpeculativeConfig(method="ngram", num_tokens=4, max_batch=4, min_n=1, max_n=3)


@pytest.fixture(scope="module")
def paged(paged_export):
    return paged_export("llama")


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
def test_greedy_with_speculation_equals_without_on_other_families_and_caches(paged_export, family, kv_cache_dtype):
    paged = paged_export(family, kv_cache_dtype)
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


def test_a_stop_word_inside_accepted_proposals_ends_the_request_where_it_would_without(paged):
    from checkpoints import byte_tokenizer

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
