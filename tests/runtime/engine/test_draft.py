"""Draft-model speculative decoding in the paged engine (runtime/engine/speculation/draft.py, speculative.py's `reject`):
greedy outputs with a draft equal those without, token for token, at batch 1, under concurrent load,
with preemption and for guided rows (proposed under their grammar); the general rejection rule keeps the target's distribution (synthetic p and q,
many draws); `distributions` is what sample_rows draws from; and end to end on a tiny model the first
speculated position follows the target's distribution while the draft's is far from it."""

import numpy as np
import pytest

from helpers import truncated
from llmc.compiler import build
from llmc.compiler.spec import parse_spec
from llmc.runtime.manifest import DraftModel, SpeculativeConfig
from llmc.runtime.runners.paged import RowStep
from llmc.runtime.engine.paged_engine import PagedEngine
from llmc.runtime.runners.paged import PagedRunner
from llmc.runtime.decoding.sampling import SamplingParams, distributions, sample_rows
from llmc.runtime.engine.speculation.speculator import reject

rng = np.random.default_rng(5)
PASSAGE = rng.integers(0, 256, 24).tolist()
PROMPTS = {"copy0": PASSAGE * 3, "copy1": rng.integers(0, 256, 5).tolist() + PASSAGE * 2 + PASSAGE[:7],
           "rand0": rng.integers(0, 256, 19).tolist(), "rand1": [9, 8], "long": rng.integers(0, 256, 70).tolist()}
TOKENS = 24
GREEDY = SamplingParams(max_tokens=TOKENS)


def _config(layout, k=4, max_batch=4, disable_batch_size=None):
    """The manifest's entry (the engine gets the draft's runner itself; serving.py makes it from this)."""
    return SpeculativeConfig(method="draft", num_tokens=k, max_batch=max_batch, min_n=2, max_n=3,
                             disable_batch_size=disable_batch_size,
                             draft=DraftModel(model_file="draft/model.onnx", kv_layout=layout, source="test",
                                              source_hash="0", quantization="none"))


def _export(checkpoint, folder):
    spec = parse_spec({"name": "t", "source": str(checkpoint), "export": {"attention": "paged"}})
    exported = build(spec, output=folder, until="export").exported
    return folder / "export", exported


@pytest.fixture(scope="module")
def models(tiny_checkpoints, tmp_path_factory, paged_export):
    """The tiny Llama (target) and its first layer alone (draft, the same byte tokenizer)."""
    root = tmp_path_factory.mktemp("draft")
    small = truncated(tiny_checkpoints["llama"], root / "small-ckpt")
    return {"target": paged_export("llama"), "small": _export(small, root / "small")}


def _runner(model, num_blocks, max_num_tokens):
    folder, exported = model
    return PagedRunner(folder / exported.onnx, exported.kv_layout, num_blocks=num_blocks,
                       max_num_tokens=max_num_tokens, num_threads=1)


def _engine(models, draft: str | None, *, k=4, max_batch=4, num_blocks=64, max_rows=8, max_num_tokens=48,
            prefix_caching=True, max_queue_size=256, max_beam_width=1, disable_batch_size=None, **kw):
    target = _runner(models["target"], num_blocks, max_num_tokens)
    common = dict(max_rows=max_rows, max_seq_len=128, max_num_tokens=max_num_tokens, prefix_caching=prefix_caching,
                  max_queue_size=max_queue_size, max_beam_width=max_beam_width, **kw)
    if draft is None:
        return PagedEngine(target, **common)
    return PagedEngine(target, **common, speculative=_config(models[draft][1].kv_layout, k, max_batch,
                                                             disable_batch_size),
                       draft=_runner(models[draft], num_blocks, max_num_tokens))


def _run(engine, requests: dict[str, tuple], beams: dict | None = None):
    """requests: name -> (prompt, params[, guide]); each request's tokens; a finished beam request's
    beams (their ids) go into `beams`."""
    for name, (prompt, params, *guide) in requests.items():
        engine.add_request(name, prompt, params, guide=guide[0] if guide else None)
    tokens = {name: [] for name in requests}
    while engine.has_work:
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
            if out.finished and out.beams is not None and beams is not None:
                beams[out.request_id] = [list(b.token_ids) for b in out.beams]
    return tokens


@pytest.fixture(scope="module")
def plain(models):
    return {name: _run(_engine(models, None), {name: (PROMPTS[name], GREEDY)})[name] for name in PROMPTS}


@pytest.mark.parametrize("draft", ["small", "target"])
def test_greedy_with_a_draft_at_batch_1_equals_without(models, plain, draft):
    """A weak draft (mostly rejected) and the target as its own draft (always accepted: every step ends
    with a bonus token, so the draft's KV lags by one token and catches up)."""
    engine = _engine(models, draft)
    for name in PROMPTS:
        assert _run(engine, {name: (PROMPTS[name], GREEDY)})[name] == plain[name], name
    spec = engine.speculator
    assert spec.num_draft_tokens > 0 and engine.blocks.num_used == 0
    if draft == "target":
        assert spec.num_accepted_tokens == spec.num_draft_tokens
    else:
        assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens


def test_greedy_with_a_draft_under_concurrent_load_equals_without(models, plain):
    engine = _engine(models, "small", max_batch=3, max_rows=5, disable_batch_size=5)  # 3 of 5 speculate
    assert _run(engine, {name: (PROMPTS[name], GREEDY) for name in PROMPTS}) == plain
    assert engine.speculator.num_accepted_tokens > 0 and engine.blocks.num_used == 0


def test_a_draft_with_preemption_no_prefix_cache_and_a_small_catch_up_budget_changes_nothing(models, plain):
    # 10 blocks of 16 for 4 requests: preemption; 24 tokens a call: the 70-token prompt's draft catches up in parts
    engine = _engine(models, "target", num_blocks=10, max_rows=4, max_num_tokens=24, prefix_caching=False)
    names = ["copy0", "copy1", "long", "rand0"]
    assert _run(engine, {n: (PROMPTS[n], GREEDY) for n in names}) == {n: plain[n] for n in names}
    assert engine.scheduler.num_preemptions > 0 and engine.speculator.num_accepted_tokens > 0
    assert engine.blocks.num_used == 0 and engine.blocks.num_free == 10


def test_beam_requests_beside_drafted_rows_get_their_solo_results(models, plain):
    """A beam group's rows get no reserved blocks and no proposals; the greedy rows beside it still
    speculate, and each request ends as it does alone."""
    beams = SamplingParams(beam_width=3, max_tokens=10)
    solo, finals = {}, {}
    _run(_engine(models, None, max_beam_width=3), {"beam": (PROMPTS["rand0"], beams)}, solo)
    engine = _engine(models, "target", max_beam_width=3)
    tokens = _run(engine, {"copy0": (PROMPTS["copy0"], GREEDY), "beam": (PROMPTS["rand0"], beams),
                           "long": (PROMPTS["long"], GREEDY)}, finals)
    assert finals == solo and len(solo["beam"]) == 3
    assert tokens["copy0"] == plain["copy0"] and tokens["long"] == plain["long"]
    assert engine.speculator.num_accepted_tokens > 0 and engine.blocks.num_used == 0


def test_guided_rows_take_a_drafts_proposals_under_their_grammar_and_keep_their_greedy_output(models):
    """A guided row's draft proposes under its grammar's mask (advanced over the proposals, then rolled
    back) and the target verifies each under the mask: greedy guided rows give the same tokens with a
    draft as without, beside unguided rows, with fast-forward on or off; a sampled guided row still
    obeys its grammar; guided rows alone do take the draft's proposals."""
    import re

    from checkpoints import byte_tokenizer
    from llmc.runtime.decoding.grammar import Guide, GuideCompiler

    compiler, end = GuideCompiler(byte_tokenizer(), [2], 256), (2,)
    regex = "[a-f]{4,20}( [0-9]{1,3})?"
    guide = lambda: compiler.compile(Guide("regex", regex))  # noqa: E731
    requests = lambda: {"g0": (PROMPTS["rand0"], GREEDY, guide()),  # noqa: E731
                        "g1": (PROMPTS["copy0"], SamplingParams(max_tokens=TOKENS, top_k=4, temperature=1.0, seed=3),
                               guide()),
                        "u0": (PROMPTS["copy1"], GREEDY), "u1": (PROMPTS["long"], GREEDY)}
    plain = _run(_engine(models, None, end_ids=end), requests())
    for fast_forward in (False, True):
        engine = _engine(models, "small", end_ids=end, fast_forward=fast_forward)
        drafted = _run(engine, requests())
        assert {k: drafted[k] for k in ("g0", "u0", "u1")} == {k: plain[k] for k in ("g0", "u0", "u1")}
        assert re.fullmatch(regex, byte_tokenizer().decode([t for t in drafted["g1"] if t != 2]))
    engine = _engine(models, "small", end_ids=end)
    assert _run(engine, {"g0": requests()["g0"]})["g0"] == plain["g0"]
    assert engine.speculator.num_draft_tokens > 0 and engine.blocks.num_used == 0


def test_a_draft_stops_speculating_with_more_requests_than_max_batch_unless_told(models):
    from llmc.runtime.engine.speculation.speculator import Speculator

    layout = models["small"][1].kv_layout
    assert Speculator.from_config(_config(layout, max_batch=3), 128).disable_batch_size == 3
    told = _config(layout, max_batch=3).model_copy(update={"disable_batch_size": 16})
    assert Speculator.from_config(told, 128).disable_batch_size == 16
    # what the limit does to a step is the scheduler's, whatever the method: test_speculative.py


def test_the_engine_refuses_a_draft_whose_pools_do_not_match(models):
    with pytest.raises(ValueError, match="draft's pools"):
        PagedEngine(_runner(models["target"], 64, 48), max_rows=4, max_seq_len=128, max_num_tokens=48,
                    speculative=_config(models["small"][1].kv_layout), draft=_runner(models["small"], 32, 48))
    with pytest.raises(ValueError, match="needs one"):
        PagedEngine(_runner(models["target"], 64, 48), max_rows=4, max_seq_len=128, max_num_tokens=48,
                    speculative=_config(models["small"][1].kv_layout))


def _tv(a, b):
    return 0.5 * np.abs(np.asarray(a) - np.asarray(b)).sum()


def test_the_rejection_rule_keeps_the_target_distribution_for_any_draft():
    """p and q over 6 tokens that disagree (q puts mass where p has little and none where p has some):
    the first kept token follows p[0], the token after an accepted first proposal follows p[1], the
    acceptance rate is sum(min(p, q)) (Leviathan et al.'s alpha) and a full acceptance adds a bonus from p[2]."""
    p = np.array([[0.4, 0.3, 0.1, 0.1, 0.1, 0.0], [0.05, 0.05, 0.5, 0.2, 0.1, 0.1], [0, 0, 0, 0, 0, 1.0]])
    q = np.array([[0.1, 0.1, 0.1, 0.0, 0.2, 0.5], [0.3, 0.3, 0.1, 0.1, 0.1, 0.1]])
    draw = np.random.default_rng(0)
    n, first, second, accepted, bonus = 40000, [], [], 0, 0
    for _ in range(n):
        x = [int(draw.choice(6, p=q[0])), int(draw.choice(6, p=q[1]))]
        kept = reject(p, q, x, draw)
        first.append(kept[0])
        accepted += kept[0] == x[0] and len(kept) > 1
        if kept[0] == x[0] and len(kept) > 1:
            second.append(kept[1])
            if len(kept) == 3:
                bonus += 1
                assert kept[2] == 5
    assert _tv(np.bincount(first, minlength=6) / n, p[0]) < 0.012
    assert _tv(np.bincount(second, minlength=6) / len(second), p[1]) < 0.02
    assert accepted / n == pytest.approx(np.minimum(p[0], q[0]).sum(), abs=0.01)
    assert bonus / len(second) == pytest.approx(np.minimum(p[1], q[1]).sum(), abs=0.015)
    # the rule is not vacuous: the draft's own first token is far from p
    assert _tv(q[0], p[0]) > 0.4


def test_distributions_are_what_sample_rows_draws_from():
    """Each knob the sampler has, penalties included: 20000 seeded draws of sample_rows over one row land
    within sampling noise of `distributions`' probabilities."""
    logits = np.random.default_rng(3).normal(0, 1.5, (1, 40)).astype(np.float32)
    prompt, output = np.array([1, 2, 3]), [4, 4, 5]
    for params in (SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=5),
                   SamplingParams(temperature=1.3, top_p=0.8, min_p=0.05),
                   SamplingParams(temperature=0.9, top_k=12, top_p=0.7, repetition_penalty=1.3,
                                  frequency_penalty=0.4, presence_penalty=0.2),
                   SamplingParams(temperature=0.9, min_tokens=5, end_ids=(int(logits.argmax()),))):
        p = distributions(logits, [params], [prompt], [output])[0]
        n = 20000
        drawn = sample_rows(np.repeat(logits, n, 0), [params] * n, [prompt] * n, [output] * n,
                            [np.random.default_rng(i) for i in range(n)])
        assert p.sum() == pytest.approx(1.0) and _tv(np.bincount(drawn, minlength=40) / n, p) < 0.03, params
    assert distributions(logits, [SamplingParams()], [prompt], [output])[0].max() == 1.0  # greedy: a point mass


def test_sampling_with_a_draft_follows_the_target_at_the_first_speculated_position(models):
    """4000 seeded requests on one prompt, each sampling 3 tokens: token 2 is the first a draft proposes
    (k 1). The empirical joint of tokens 1 and 2 matches the target's exact one (its distributions after
    the prompt and after each token 1) within a total-variation bound, while the draft's joint is far."""
    prompt = PROMPTS["rand0"]
    params = SamplingParams(max_tokens=3, temperature=0.8, top_k=6, repetition_penalty=1.1)
    n = 4000
    engine = _engine(models, "small", k=1, max_batch=64, max_rows=64, num_blocks=256, max_num_tokens=512,
                     max_queue_size=n, disable_batch_size=n)  # speculating with all n queued
    requests = {f"r{i}": (prompt, params.model_copy(update={"seed": i})) for i in range(n)}
    tokens = _run(engine, requests)
    pairs = [tuple(t[:2]) for t in tokens.values()]
    assert engine.speculator.num_draft_tokens >= n // 2 and 0 < engine.speculator.num_accepted_tokens

    def joint(second_model):  # the joint of tokens 1 (the target's) and 2 (`second_model`'s), exactly
        runners = {name: _runner(models[name], 16, 128) for name in ("target", second_model)}
        first = distributions(runners["target"].step([RowStep(prompt, 0, list(range(8)))]), [params], [prompt],
                              [[]])[0]
        runners[second_model].step([RowStep(prompt, 0, list(range(8)))])
        out = {}
        for t1 in np.nonzero(first)[0]:
            second = distributions(runners[second_model].step([RowStep([int(t1)], len(prompt), list(range(8)))]),
                                   [params], [prompt], [[int(t1)]])[0]
            out.update({(int(t1), int(t2)): first[t1] * second[t2] for t2 in np.nonzero(second)[0]})
        return out

    target, draft = joint("target"), joint("small")
    cells = sorted(set(target) | set(draft) | set(pairs))
    counts = {c: 0 for c in cells}
    for pair in pairs:
        counts[pair] += 1
    empirical = np.array([counts[c] / n for c in cells])
    exact = np.array([target.get(c, 0.0) for c in cells])
    assert set(pairs) <= {c for c in target if target[c] > 0}
    assert _tv(empirical, exact) < 0.06
    # what keeping every proposal would give (token 2 from the draft) is far away
    assert _tv(np.array([draft.get(c, 0.0) for c in cells]), exact) > 0.3


def test_sampled_requests_with_penalties_and_logprobs_are_served_with_a_draft(models):
    """Every sampling knob with a draft, each request seeded: the tokens repeat run to run, min_tokens
    holds the end id off, and the log probabilities are the target's: teacher-forcing the output
    through the target alone gives the same values."""
    from llmc.runtime.decoding.logprobs import log_softmax

    requests = {"a": SamplingParams(max_tokens=TOKENS, temperature=0.7, top_k=8, top_p=0.9, seed=1),
                "b": SamplingParams(max_tokens=TOKENS, temperature=1.0, min_p=0.05, repetition_penalty=1.3,
                                    frequency_penalty=0.5, presence_penalty=0.3, seed=2),
                "c": SamplingParams(max_tokens=TOKENS, temperature=0.5, min_tokens=12, end_ids=(7,), seed=3)}
    prompts = {"a": PROMPTS["copy0"], "b": PROMPTS["copy1"], "c": PROMPTS["rand0"]}

    def run():
        engine = _engine(models, "small", k=3)
        for name, params in requests.items():
            engine.add_request(name, prompts[name], params, logprobs=0)
        tokens, values = {name: [] for name in requests}, {name: [] for name in requests}
        while engine.has_work:
            for out in engine.step():
                tokens[out.request_id] += out.token_ids
                values[out.request_id] += out.logprobs.values.tolist()
        return tokens, values, engine

    tokens, values, engine = run()
    assert run()[0] == tokens and engine.speculator.num_accepted_tokens > 0
    assert 7 not in tokens["c"][:12]
    runner = _runner(models["target"], 16, 256)
    for name, out in tokens.items():
        ids = prompts[name] + out
        logits = runner.step([RowStep(ids[:-1], 0, list(range(16)), len(out))])
        expected = [float(log_softmax(row)[t]) for row, t in zip(logits, out)]
        np.testing.assert_allclose(values[name], expected, atol=1e-4, err_msg=name)
