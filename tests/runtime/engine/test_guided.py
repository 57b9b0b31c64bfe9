"""Guided requests in the paged engine on a real (tiny, random) paged graph: the output always obeys
the guide and ends where the grammar ends; a guided request's greedy output is the same alone and
among unguided requests, with prompt-lookup speculation on or off (guided rows take the proposals
their grammar accepts; the others speculate in the same steps), and with the fast-forward of forced
tokens on or off (log probabilities included); max_tokens still truncates; beam search with a guide
is refused naming the input."""

import json

import jsonschema
import numpy as np
import pytest

from checkpoints import byte_tokenizer
from llmc.runtime.decoding.grammar import Guide, GuideCompiler
from llmc.runtime.decoding.logprobs import Logprobs
from llmc.runtime.decoding.sampling import SamplingParams
from llmc.runtime.engine.paged_engine import PagedEngine
from llmc.runtime.engine.sequence import FinishReason
from llmc.runtime.manifest import SpeculativeConfig
from llmc.runtime.runners.paged import PagedRunner

END = 2
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["kind", "ok", "tag"],
          "properties": {"kind": {"enum": ["cat", "dog", "eel"]}, "ok": {"type": "boolean"},
                         "tag": {"type": "string", "maxLength": 4}}}
rng = np.random.default_rng(5)
PASSAGE = rng.integers(3, 256, 16).tolist()
PROMPTS = {"copy0": PASSAGE * 3, "copy1": PASSAGE[:9] * 4, "rand": rng.integers(3, 256, 11).tolist(),
           # JSON the schema takes, repeated: prompt lookup proposes its continuations to the guided rows
           "json": byte_tokenizer().encode('{"kind": "eel", "ok": false, "tag": "ab"}\n' * 2).ids}
SPEC = SpeculativeConfig(method="ngram", num_tokens=4, max_batch=4, min_n=1, max_n=3)


@pytest.fixture(scope="module")
def paged(paged_export):
    return paged_export("llama")


@pytest.fixture(scope="module")
def guides():
    compiler = GuideCompiler(byte_tokenizer(), [END], 256)
    yield compiler
    compiler.close()


def _engine(paged, speculative=None, max_beam_width=1, fast_forward=True):
    folder, exported = paged
    runner = PagedRunner(folder / exported.onnx, exported.kv_layout, num_blocks=64, max_num_tokens=48, num_threads=1)
    return PagedEngine(runner, end_ids=(END,), max_rows=8, max_seq_len=128, max_num_tokens=48,
                       speculative=speculative, max_beam_width=max_beam_width, fast_forward=fast_forward)


def _run(engine, requests):
    """requests: name -> (prompt name, params, guide or None); each request's tokens and finish reason."""
    tokens, reasons, _, _ = _collect(engine, {name: (*r, None) for name, r in requests.items()})
    return tokens, reasons


def _collect(engine, requests):
    """requests: name -> (prompt name, params, guide or None, top log probabilities or None); each
    request's tokens, finish reason and log probabilities (values, top ids), and the steps run."""
    for name, (prompt, params, guide, logprobs) in requests.items():
        engine.add_request(name, PROMPTS[prompt], params, logprobs=logprobs, guide=guide)
    tokens, reasons, logprobs, steps = {name: [] for name in requests}, {}, {name: [] for name in requests}, 0
    while engine.has_work:
        steps += 1
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
            if out.logprobs is not None:
                logprobs[out.request_id].append(out.logprobs)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    joined = {name: Logprobs.concat(parts) for name, parts in logprobs.items() if parts}
    return tokens, reasons, joined, steps


def _schema(guides):
    return guides.compile(Guide("json_schema", json.dumps(SCHEMA)))


def _text(ids):
    return byte_tokenizer().decode([t for t in ids if t != END])


def test_guided_greedy_output_validates_and_ends_with_the_grammar(paged, guides):
    names = ("copy0", "copy1", "rand")
    tokens, reasons = _run(_engine(paged), {p: (p, SamplingParams(max_tokens=60), _schema(guides)) for p in names})
    for name in names:
        jsonschema.validate(json.loads(_text(tokens[name])), SCHEMA)
        assert reasons[name] is FinishReason.stop
    free, _ = _run(_engine(paged), {"rand": ("rand", SamplingParams(max_tokens=20), None)})
    assert not _text(free["rand"]).startswith("{")  # the tiny model alone writes no JSON: the mask did


def test_sampled_guided_output_validates(paged, guides):
    requests = {f"s{seed}": ("rand", SamplingParams(max_tokens=60, temperature=1.5, top_p=0.95, seed=seed),
                             _schema(guides)) for seed in range(4)}
    tokens, reasons = _run(_engine(paged), requests)
    for name in requests:
        jsonschema.validate(json.loads(_text(tokens[name])), SCHEMA)


def test_a_guided_request_is_the_same_alone_and_among_unguided_ones(paged, guides):
    alone, _ = _run(_engine(paged), {"g": ("rand", SamplingParams(max_tokens=40), _schema(guides))})
    mixed, _ = _run(_engine(paged), {"a": ("copy0", SamplingParams(max_tokens=30), None),
                                     "g": ("rand", SamplingParams(max_tokens=40), _schema(guides)),
                                     "b": ("copy1", SamplingParams(max_tokens=30, temperature=1.0, seed=3), None)})
    assert mixed["g"] == alone["g"]


def test_greedy_guided_output_is_the_same_with_and_without_speculation(paged, guides):
    """Guided rows take the prompt-lookup proposals their grammar accepts, verified under the mask at
    each position (the matcher rolled back over the rejected ones); unguided rows speculate beside them."""
    def requests(guided_only=False):
        regex = guides.compile(Guide("regex", "[a-f]{3,12}"))
        out = {"g0": ("json", SamplingParams(max_tokens=40), _schema(guides)),
               "g1": ("copy1", SamplingParams(max_tokens=40), regex),
               "g2": ("json", SamplingParams(max_tokens=40, temperature=0.7, top_k=5, seed=1), _schema(guides))}
        if not guided_only:
            out.update({"u0": ("copy0", SamplingParams(max_tokens=30), None),
                        "u1": ("copy1", SamplingParams(max_tokens=30), None)})
        return out

    plain, _ = _run(_engine(paged), requests())
    engine = _engine(paged, SPEC)
    speculated, reasons = _run(engine, requests())
    assert speculated == _run(_engine(paged, SPEC, fast_forward=False), requests())[0]  # seeded g2 too
    assert {k: v for k, v in speculated.items() if k != "g2"} == {k: v for k, v in plain.items() if k != "g2"}
    if reasons["g2"] is FinishReason.stop:  # sampled: its own draws, valid when it finished
        jsonschema.validate(json.loads(_text(speculated["g2"])), SCHEMA)
    else:
        assert len(speculated["g2"]) == 40
    engine = _engine(paged, SPEC, fast_forward=False)  # a row with forced tokens takes no n-gram proposals
    alone, _ = _run(engine, {k: v for k, v in requests(guided_only=True).items() if k == "g0"})
    assert alone["g0"] == plain["g0"]
    assert engine.speculator.num_accepted_tokens > 0  # the guided row itself took proposals


def test_fast_forwarded_forced_tokens_change_no_output_nor_log_probabilities(paged, guides):
    """A guided row's forced tokens (the schema's keys and punctuation, a choice's common prefix) ride
    in its next step as proposals verified under the mask: greedy tokens, finish reasons (max_tokens
    inside a forced run included) and each token's log probabilities, forced ones too, are those of a
    run that samples every token, in fewer steps."""
    def requests():
        choice = guides.compile(Guide("choice", json.dumps(["alpha beta", "alpha gamma"])))
        return {"g0": ("rand", SamplingParams(max_tokens=60), _schema(guides), 3),
                "g1": ("copy1", SamplingParams(max_tokens=9), _schema(guides), None),  # cut 7 tokens into `"kind": "`
                "g2": ("json", SamplingParams(max_tokens=30), choice, 2),
                "g3": ("copy0", SamplingParams(max_tokens=40, temperature=0.9, seed=4), _schema(guides), None),
                "u": ("copy0", SamplingParams(max_tokens=20), None, 1)}

    off = _collect(_engine(paged, fast_forward=False), requests())
    engine = _engine(paged)
    on = _collect(engine, requests())
    assert on[0] == off[0] and on[1] == off[1]  # g3 too: a seeded row draws from the same uniforms either way
    assert on[1]["g1"] is FinishReason.length and len(on[0]["g1"]) == 9
    for name in ("g0", "g2", "u"):
        assert len(on[2][name]) == len(on[0][name])
        np.testing.assert_allclose(on[2][name].values, off[2][name].values, atol=1e-4)
        np.testing.assert_array_equal(on[2][name].top_ids, off[2][name].top_ids)
    assert _text(on[0]["g3"]).startswith('{"kind": "') and len(set(on[0]["g3"])) > 8
    assert engine.scheduler.num_forced_tokens >= 20 and on[3] < off[3]


def test_max_tokens_still_truncates_a_guided_request(paged, guides):
    tokens, reasons = _run(_engine(paged), {"g": ("rand", SamplingParams(max_tokens=5), _schema(guides))})
    assert len(tokens["g"]) == 5 and reasons["g"] is FinishReason.length
    assert _text(tokens["g"]).startswith("{")


def test_beam_search_with_a_guide_is_refused_naming_the_input(paged, guides):
    engine = _engine(paged, max_beam_width=2)
    with pytest.raises(ValueError, match="^guided_decoding_guide: not with beam search"):
        engine.add_request("b", PROMPTS["rand"], SamplingParams(beam_width=2), guide=_schema(guides))


def test_drawing_first_and_redrawing_on_a_refusal_gives_the_masked_distribution(guides):
    """A sampled row without top-k/p draws unmasked and is masked only when the grammar refuses the
    token (core.py): its tokens follow the masked softmax, here with the likeliest tokens forbidden."""
    from llmc.runtime.engine.core import EngineCore
    from llmc.runtime.engine.sequence import Sequence

    core = EngineCore(scheduler=None, end_ids=(END,), capacity=64)
    allowed = [byte_tokenizer().encode(ch).ids[0] for ch in "abcd"]
    logits = np.zeros(256, np.float32)
    logits[allowed] = [0.0, 0.5, 1.0, 1.5]
    logits[[100, 101]] = 3.0  # forbidden, and drawn most of the time before the grammar refuses them
    seqs = [Sequence(f"s{i}", [1], SamplingParams(temperature=1.0, seed=i, end_ids=(END,)),
                     guide=guides.compile(Guide("regex", "[a-d]"))) for i in range(3000)]
    sampled: dict[str, list[int]] = {}
    for lo in range(0, len(seqs), 500):
        core.sample(seqs[lo:lo + 500], np.tile(logits, (500, 1)), sampled)
    counts = np.array([sum(ids == [t] for ids in sampled.values()) for t in allowed])
    expected = np.exp(logits[allowed]) / np.exp(logits[allowed]).sum()
    assert counts.sum() == len(seqs)
    assert np.abs(counts / counts.sum() - expected).max() < 0.03, (counts / counts.sum(), expected)
