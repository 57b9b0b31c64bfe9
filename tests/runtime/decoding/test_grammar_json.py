"""The JSON a schema guide lets a model write (runtime/decoding/grammar.py's _JSON_OPTIONS): json.dumps's
layout and no other blanks, so no model can spend max_tokens on whitespace and a schema's keys are forced
tokens; and an object takes other keys only where its schema lets it (issue 51: a strict request's schema
had none of additionalProperties, and the answer had an undeclared key)."""

import json

import pytest

from checkpoints import byte_tokenizer
from helpers import grammar_takes
from llmc.runtime.decoding.grammar import Guide, GuideCompiler

END = 0
CITY = {"type": "object", "additionalProperties": False, "required": ["name", "tags", "population"],
        "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "integer"}},
                       "population": {"type": "integer"}}}
VALUE = {"name": "Oslo", "tags": [1, 2], "population": 700000}


@pytest.fixture(scope="module")
def compiler():
    c = GuideCompiler(byte_tokenizer(), [END], 256)
    yield c
    c.close()


def _takes(compiler, schema, text: str) -> bool:
    """Whether the schema's grammar takes exactly `text` and may end there."""
    return grammar_takes(compiler, Guide("json_schema", json.dumps(schema)), text, END)


def test_json_dumps_layout_is_taken(compiler):
    assert _takes(compiler, CITY, json.dumps(VALUE))


@pytest.mark.parametrize("text", [
    json.dumps(VALUE, indent=2), json.dumps(VALUE, separators=(",", ":")),
    '{"name": "x",' + " " * 3 + '"tags": [], "population": 1}', '{"name": "x", "tags": [], "population": 1\n}',
    ' {"name": "x", "tags": [], "population": 1}', '{"name": "x", "tags": [], "population": 1}\n',
])
def test_no_other_blanks_so_none_can_fill_max_tokens(compiler, text):
    assert not _takes(compiler, CITY, text)


def test_the_keys_in_the_schemas_order_are_forced(compiler):
    matcher = compiler.compile(Guide("json_schema", json.dumps(CITY)))
    assert byte_tokenizer().decode(matcher.forced_tokens(20, (END,))) == '{"name": "'


def test_other_keys_only_where_the_schema_allows_them(compiler):
    extra = '{"name": "x", "tags": [], "population": 1, "population_density": 8.1}'
    assert not _takes(compiler, CITY, extra)
    # JSON Schema's default: an object without additionalProperties takes other keys (a strict request is
    # refused unless its objects say additionalProperties false: llmc/openai/structured.py)
    assert _takes(compiler, {k: v for k, v in CITY.items() if k != "additionalProperties"}, extra)
