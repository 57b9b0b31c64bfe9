"""Regexes read as ECMA-262 wherever a guide carries one (runtime/decoding/regex.py): a regex guide (from
structured_outputs.regex or TensorRT-LLM's guided_decoding_guide_type regex) and a JSON schema's patterns
agree on \\d, \\w, \\s, their complements and `.`, inside classes too, and none of them takes a non-ASCII
digit for \\d (U+1FBF8 SEGMENTED DIGIT EIGHT was how a date regex answered on SmolLM2: issue 51)."""

import json

import pytest

from checkpoints import byte_tokenizer
from helpers import grammar_takes
from llmc.runtime.decoding.grammar import Guide, GuideCompiler, GuideError
from llmc.runtime.decoding.regex import ecma_schema, ecma_to_rust

END = 0
SEG8, ARABIC3, FULLWIDTH1 = "\U0001FBF8", "\u0663", "\uff11"

# (ECMA-262 regex, text, whether it matches the whole text in ECMA-262 with the u flag)
CASES = [
    (r"\d{4}-\d{2}-\d{2}", "2024-01-31", True),
    (r"\d{4}-\d{2}-\d{2}", f"{SEG8 * 4}-{SEG8 * 2}-{SEG8 * 2}", False),
    (r"\d", ARABIC3, False), (r"\d", FULLWIDTH1, False), (r"\D", SEG8, True), (r"\D", "7", False),
    (r"[\d.]+", "3.14", True), (r"[\d.]+", SEG8, False), (r"[^\d]", SEG8, True), (r"[^\d]", "1", False),
    (r"\w+", "ab_9Z", True), (r"\w", "é", False), (r"\w", "\u0661", False), (r"\W", "é", True),
    (r"\s", "\ufeff", True), (r"\s", "\u00a0", True), (r"\s", "\u0085", False), (r"\S", "\u0085", True),
    (r"a.b", "a\rb", False), (r"a.b", "a\u2028b", False), (r"a.b", "aéb", True), (r"a[^]b", "a\nb", True),
    (r"\\d", "\\d", True), (r"\\d", "\\1", False), (r"\\\d", "\\1", True),  # escaped backslashes
    (r"[[]", "[", True), (r"[a&&b]", "&", True), (r"[\d-z]", "-", True), (r"[a-\d]", "b", False),
    (r"[\b]", "\b", True), (r"\cJ", "\n", True), (r"\u0041\x42\/", "AB/", True),
]


@pytest.fixture(scope="module")
def compiler():
    c = GuideCompiler(byte_tokenizer(), [END], 256)
    yield c
    c.close()


def _matches(compiler, guide: Guide, text: str) -> bool:
    return grammar_takes(compiler, guide, text, END)


@pytest.mark.parametrize("regex, text, match", CASES)
def test_a_regex_guide_reads_ecma_262(compiler, regex, text, match):
    assert _matches(compiler, Guide("regex", regex), text) is match, ecma_to_rust(regex)


@pytest.mark.parametrize("regex, text, match", CASES)
def test_a_schema_pattern_reads_the_same(compiler, regex, text, match):
    schema = {"type": "string", "pattern": f"^(?:{regex})$"}
    assert _matches(compiler, Guide("json_schema", json.dumps(schema)),
                    json.dumps(text, ensure_ascii=False)) is match


def test_patterns_anywhere_in_a_schema_and_its_property_names_read_ecma(compiler):
    date = r"^\d{4}$"
    schema = {"type": "object", "additionalProperties": False, "required": ["d"],
              "properties": {"d": {"$ref": "#/$defs/year"}},
              "patternProperties": {r"^x\d$": {"anyOf": [{"type": "string", "pattern": date}]}},
              "$defs": {"year": {"type": "string", "pattern": date}}}
    guide = Guide("json_schema", json.dumps(schema))
    assert _matches(compiler, guide, '{"d": "2024", "x1": "1999"}')
    assert not _matches(compiler, guide, json.dumps({"d": SEG8 * 4}, ensure_ascii=False))
    assert not _matches(compiler, guide, json.dumps({"d": "2024", "x1": ARABIC3 * 4}, ensure_ascii=False))
    assert not _matches(compiler, guide, json.dumps({"d": "2024", "x" + SEG8: "1999"}, ensure_ascii=False))


def test_data_in_a_schema_is_not_read_as_a_pattern():
    schema = {"const": {"pattern": r"\d"}, "enum": [{"pattern": r"\d"}], "default": {"pattern": "."},
              "properties": {"pattern": {"type": "string", "pattern": r"\d"}}}
    out = ecma_schema(schema)
    assert out["const"] == out["enum"][0] == {"pattern": r"\d"} and out["default"] == {"pattern": "."}
    assert out["properties"]["pattern"]["pattern"] == "[0-9]"
    assert schema["properties"]["pattern"]["pattern"] == r"\d"  # a copy: the request's schema is left alone


@pytest.mark.parametrize("regex, words", [("[ab", "not closed"), ("ab\\", "lone backslash"), ("[]", "empty class"),
                                          (r"(?=a)a", "look"), (r"(a)\1", "backreference")])
def test_a_regex_that_cannot_be_read_is_refused_naming_the_input(compiler, regex, words):
    with pytest.raises(GuideError) as err:
        compiler.compile(Guide("regex", regex))
    assert str(err.value).startswith("guided_decoding_guide") and words in str(err.value), str(err.value)
