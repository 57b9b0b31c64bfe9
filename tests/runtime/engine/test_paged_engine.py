"""The engine over the paged KV cache (runtime/engine/paged_engine.py) on a real paged graph: every greedy
result under concurrent load with shared prefixes equals its solo result and PyTorch's, with prefix
caching on and off and across preemptions; prompts that can never fit are refused at admission, a
full pool only queues."""

import numpy as np
import pytest

from serving_rig import greedy_reference
from llmc.runtime.engine.paged_engine import PagedEngine
from llmc.runtime.runners.paged import PagedRunner
from llmc.runtime.decoding.sampling import SamplingParams
from llmc.runtime.engine.sequence import FinishReason

rng = np.random.default_rng(7)
SHARED = rng.integers(0, 256, 37).tolist()  # a "system prompt" several requests start with
PROMPTS = {f"s{i}": SHARED + rng.integers(0, 256, n).tolist() for i, n in enumerate((3, 9, 17, 1))}
PROMPTS.update({"solo": rng.integers(0, 256, 23).tolist(), "short": [5, 6]})
TOKENS = 10


@pytest.fixture(scope="module")
def paged(paged_export):
    return paged_export("llama")


def _engine(paged, *, num_blocks=64, max_rows=8, max_num_tokens=24, prefix_caching=True, itl_ratio=None):
    folder, exported = paged
    runner = PagedRunner(folder / exported.onnx, exported.kv_layout, num_blocks=num_blocks,
                         max_num_tokens=max_num_tokens, num_threads=1)
    return PagedEngine(runner, max_rows=max_rows, max_seq_len=128, max_num_tokens=max_num_tokens,
                       prefix_caching=prefix_caching, itl_ratio=itl_ratio)


def _run(engine, names, max_tokens=TOKENS):
    for name in names:
        engine.add_request(name, PROMPTS[name], SamplingParams(max_tokens=max_tokens))
    tokens = {name: [] for name in names}
    while engine.has_work:
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
    return tokens


@pytest.fixture(scope="module")
def solo(paged):
    return {name: _run(_engine(paged), [name])[name] for name in PROMPTS}


def test_solo_results_are_pytorchs_greedy(solo, tiny_checkpoints):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints["llama"]).eval()
    for name in ("s0", "solo", "short"):
        assert solo[name] == greedy_reference(model, PROMPTS[name], TOKENS), name


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-caching", "no-prefix-caching"])
def test_concurrent_requests_with_shared_prefixes_equal_their_solo_results(paged, solo, prefix_caching):
    engine = _engine(paged, prefix_caching=prefix_caching)
    assert _run(engine, list(PROMPTS)) == solo
    blocks = engine.blocks
    assert blocks.num_used == 0 and engine.scheduler.num_preemptions == 0
    assert (blocks.prefix_hits > 0) == prefix_caching  # the later s* requests reuse the first one's blocks


def test_capping_prompt_tokens_by_step_cost_changes_no_result(paged, solo):
    engine = _engine(paged, itl_ratio=1.2)  # tight: prompts go in small chunks beside the decode rows
    assert _run(engine, list(PROMPTS)) == solo
    assert engine.cost.steps > 0 and engine.cost.coefficients() is not None


def test_preemption_recomputes_and_changes_nothing(paged, solo):
    engine = _engine(paged, num_blocks=8, max_rows=4)  # 8 blocks of 16: too few for four long rows at once
    assert _run(engine, ["s0", "s1", "s2", "solo"]) == {n: solo[n] for n in ("s0", "s1", "s2", "solo")}
    assert engine.scheduler.num_preemptions > 0 and engine.blocks.num_used == 0


def test_steps_mix_decode_rows_and_prompt_chunks(paged, solo):
    engine = _engine(paged, max_num_tokens=8)
    engine.add_request("short", PROMPTS["short"], SamplingParams(max_tokens=TOKENS))
    engine.step()  # prefilled, first token
    engine.add_request("solo", PROMPTS["solo"], SamplingParams(max_tokens=TOKENS))
    chunks = engine.scheduler.schedule()
    assert [(c.seq.request_id, len(c.token_ids)) for c in chunks] == [("short", 1), ("solo", 7)]


def test_a_prompt_the_pool_cannot_hold_is_refused_and_a_full_pool_queues(paged, solo):
    engine = _engine(paged, num_blocks=2)
    with pytest.raises(ValueError, match=r"needs 3 KV blocks and the whole pool has 2 \(limits.kv_cache_tokens\)"):
        engine.add_request("s0", PROMPTS["s0"], SamplingParams(max_tokens=4))
    tokens = _run(engine, ["short", "solo"])  # one at a time: the second waits for the first's blocks
    assert tokens == {"short": solo["short"], "solo": solo["solo"]}


def test_max_seq_len_finishes_a_request_with_length(paged):
    engine = _engine(paged)
    engine.core.capacity = len(PROMPTS["short"]) + 4
    engine.add_request("short", PROMPTS["short"], SamplingParams(max_tokens=50))
    reasons, tokens = {}, []
    while engine.has_work:
        outputs = engine.step()
        tokens += [t for o in outputs for t in o.token_ids]
        reasons.update({o.request_id: o.finish_reason for o in outputs if o.finished})
    assert reasons == {"short": FinishReason.length} and len(tokens) == 5  # the last token needs no KV


def test_a_request_that_outgrows_the_whole_pool_ends_with_length(paged):
    """Alone in a pool of 2 blocks (32 tokens) a request asking for 50 tokens fills it and ends with
    `length`, its tokens those of a roomy pool; preempting it would only recompute it back there."""
    roomy = _run(_engine(paged), ["short"], max_tokens=50)["short"]
    engine = _engine(paged, num_blocks=2)
    engine.add_request("short", PROMPTS["short"], SamplingParams(max_tokens=50))
    tokens, reasons = [], {}
    for _ in range(100):
        if not engine.has_work:
            break
        for out in engine.step():
            tokens += out.token_ids
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    assert reasons == {"short": FinishReason.length} and engine.scheduler.num_preemptions == 0
    assert len(PROMPTS["short"]) + len(tokens) == 2 * 16 + 1 and tokens == roomy[:len(tokens)]
