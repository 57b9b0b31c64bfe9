"""Structured output's grammar wing (runtime/decoding/grammar.py) without a model: guides compile with
llguidance (errors name the input), the cache keys on (kind, guide, tokenizer), and random logits
sampled through the bitmask always give outputs the guide accepts, ending only where it may end."""

import json
import re

import jsonschema
import numpy as np
import pytest

from checkpoints import byte_tokenizer
from llmc.runtime.decoding.grammar import (Guide, GuideCompiler, GuideError, apply_bitmask, next_token_bitmask,
                                           token_bitmask)
from llmc.runtime.decoding.sampling import SamplingParams, sample_rows

END = 0  # the byte tokenizer's id 0 stands for the end id here
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "tags", "size"],
          "properties": {"name": {"type": "string", "maxLength": 6}, "size": {"enum": ["S", "M", "L"]},
                         "tags": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
                         "note": {"anyOf": [{"type": "null"}, {"type": "boolean"}]}}}


@pytest.fixture(scope="module")
def compiler():
    c = GuideCompiler(byte_tokenizer(), [END], 256)
    yield c
    c.close()


def _bytes_text(ids):  # the byte tokenizer's ids are its ByteLevel alphabet, not raw bytes: decode through it
    return byte_tokenizer().decode(ids)


@pytest.mark.parametrize("seed", range(6))
def test_sampled_outputs_validate_against_the_schema(compiler, seed):
    matcher = compiler.compile(Guide("json_schema", json.dumps(SCHEMA)))
    rng = np.random.default_rng(seed)
    p = SamplingParams(temperature=1.0, end_ids=(END,), max_tokens=300)
    out: list[int] = []
    while not matcher.is_stopped:
        bitmask = next_token_bitmask([matcher], [p.end_ids], [END], 256)
        token = int(sample_rows(rng.normal(0, 3, (1, 256)).astype(np.float32), [p], [[1]], [out], [rng],
                                ([0], bitmask))[0])
        if token == END:
            break
        out.append(token)
        matcher.consume(token)
        assert len(out) < 300
    jsonschema.validate(json.loads(_bytes_text(out)), SCHEMA)


def test_regex_choice_and_grammars_constrain_the_output(compiler):
    tok = byte_tokenizer()
    cases = [(Guide("regex", r"[a-c]{2,4}-[0-9]"), lambda s: re.fullmatch(r"[a-c]{2,4}-[0-9]", s)),
             (Guide("choice", json.dumps(["yes", "no", "maybe"])), lambda s: s in ("yes", "no", "maybe")),
             (Guide("ebnf_grammar", 'root ::= "(" [xy]+ ")"'), lambda s: re.fullmatch(r"\([xy]+\)", s)),
             (Guide("lark_grammar", 'start: "a" B\nB: /[0-9]+/'), lambda s: re.fullmatch(r"a[0-9]+", s)),
             (Guide("json", ""), lambda s: isinstance(json.loads(s), dict))]
    for guide, ok in cases:
        for seed in range(3):
            matcher = compiler.compile(guide)
            rng = np.random.default_rng(seed)
            out: list[int] = []
            while not matcher.is_stopped and len(out) < 60:
                bitmask = next_token_bitmask([matcher], [(END,)], [END], 256)
                logits = apply_bitmask(rng.normal(0, 3, (1, 256)).astype(np.float32), [0], bitmask)
                token = int(np.argmax(logits[0] + rng.gumbel(size=256)))
                if token == END:
                    break
                out.append(token)
                matcher.consume(token)
            assert ok(tok.decode(out)), (guide, tok.decode(out))


def test_the_end_id_is_allowed_only_where_the_grammar_may_end(compiler):
    matcher = compiler.compile(Guide("regex", "ab+"))
    allowed = lambda: np.unpackbits(next_token_bitmask([matcher], [(END,)], [END], 256).view(np.uint8),
                                    bitorder="little").astype(bool)
    a, b = (byte_tokenizer().encode(ch).ids[0] for ch in "ab")
    assert not allowed()[END] and allowed()[a] and allowed().sum() == 1
    matcher.consume(a)
    assert not allowed()[END]
    matcher.consume(b)
    assert allowed()[END] and allowed()[b]  # "ab" may end or go on
    # a request's own end id (not the model's) takes the model's place
    bitmask = next_token_bitmask([matcher], [(7,)], [END], 256)
    bits = np.unpackbits(bitmask.view(np.uint8), bitorder="little").astype(bool)
    assert bits[7] and not bits[END]


def test_the_mask_applies_before_temperature_and_top_k(compiler):
    """The best token overall is forbidden: top_k=1 and greedy both take the best allowed one."""
    matcher = compiler.compile(Guide("choice", json.dumps(["x", "y"])))
    x, y = (byte_tokenizer().encode(ch).ids[0] for ch in "xy")
    logits = np.zeros((1, 256), np.float32)
    logits[0, 100], logits[0, x], logits[0, y] = 50.0, 2.0, 1.0
    bitmask = token_bitmask([matcher], 256)
    for params in (SamplingParams(), SamplingParams(temperature=0.7, top_k=1), SamplingParams(temperature=5, min_p=0.9)):
        token = sample_rows(logits, [params], [[1]], [[]], [params.make_rng()], ([0], bitmask))[0]
        assert token == x, params
    # rows not named keep their logits; tokens past the bitmask's width are never allowed
    wide = np.zeros((2, 300), np.float32)
    wide[:, 290] = 9.0
    masked = apply_bitmask(wide, [1], bitmask)
    assert masked[0, 290] == 9.0 and masked[1, 290] == -np.inf and np.isfinite(masked[1, [x, y]]).all()


@pytest.mark.parametrize("guide, words", [
    (Guide("regex", "a(("), "unclosed group"),
    (Guide("json_schema", "{not json"), "not valid JSON"),
    (Guide("json_schema", json.dumps({"type": "string", "format": "no-such-format"})), "no-such-format"),
    (Guide("choice", "[1, 2]"), "JSON list of strings"),
    (Guide("lark_grammar", "start: undefined_rule"), "undefined_rule"),
])
def test_a_guide_that_does_not_compile_names_the_input_and_says_why(compiler, guide, words):
    with pytest.raises(GuideError) as err:
        compiler.submit(guide).result(timeout=30)
    assert str(err.value).startswith("guided_decoding_guide: ") and words in str(err.value)


def test_compiled_guides_are_cached_per_guide_and_tokenizer(compiler):
    guide = Guide("regex", "cache[0-9]")
    first, second = compiler.compile(guide), compiler.compile(guide)
    assert first.llmatcher is not second.llmatcher  # each request gets its own state
    keys = [k for k in GuideCompiler._cache if k[:2] == ("regex", "cache[0-9]")]
    assert len(keys) == 1
    same, wider = GuideCompiler(byte_tokenizer(), [END], 256), GuideCompiler(byte_tokenizer(), [END], 512)
    same.compile(guide)  # the same tokenizer shares the entry; another vocabulary size makes its own
    assert len([k for k in GuideCompiler._cache if k[:2] == ("regex", "cache[0-9]")]) == 1
    wider.compile(guide)
    assert len([k for k in GuideCompiler._cache if k[:2] == ("regex", "cache[0-9]")]) == 2
    same.close(), wider.close()


def test_masks_along_proposals_match_step_by_step_and_roll_back(compiler):
    """Speculation's masks (bitmasks_along): after each prefix of the proposals, as consuming them one by
    one gives; the matcher is where it was afterwards; valid_prefix stops where the grammar refuses."""
    tok = byte_tokenizer()
    guide = Guide("regex", "ab[0-9]{2}c")
    proposals = tok.encode("ab12").ids
    matcher = compiler.compile(guide)
    assert matcher.valid_prefix(tok.encode("ab1x2").ids, (END,)) == 3
    assert matcher.valid_prefix(proposals + [END], (END,)) == 4  # an end id ends the proposals
    along = matcher.bitmasks_along(proposals, (END,), [END], 256)
    step = compiler.compile(guide)
    for j in range(len(proposals) + 1):
        assert (along[j] == next_token_bitmask([step], [(END,)], [END], 256)[0]).all(), j
        if j < len(proposals):
            step.consume(proposals[j])
    assert matcher.valid_prefix(proposals, (END,)) == 4  # rolled back: the same proposals fit again
    for t in proposals:
        matcher.consume(t)
    assert not matcher.is_stopped and matcher.allows(tok.encode("c").ids[0], (END,))
