"""The OpenAI API's structured output and tool calls without a server (llmc/openai/structured.py): each
request field becomes the served model's guide, every field llmc cannot honour is a 400 naming it, and
a tool choice's output becomes tool_calls, whole or streamed (the streamed pieces add up to the whole)."""

import json

import jsonschema
import pytest

from llmc.openai.protocol import ChatRequest, CompletionRequest, OpenAIError, model_error
from llmc.openai.structured import ToolCallStream, guide_of, tool_calls

MESSAGES = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time"}}]


def _chat(**fields):
    return ChatRequest(model="m", messages=MESSAGES, **fields)


def test_response_format_and_structured_outputs_become_guides():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    g = guide_of(_chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema,
                                                                                "strict": True}}))
    assert (g.kind, json.loads(g.text), g.param) == ("json_schema", schema, "response_format")
    assert guide_of(_chat(response_format={"type": "json_object"})).kind == "json"
    assert guide_of(_chat(response_format={"type": "text"})) is None
    completion = CompletionRequest(model="m", prompt="p", structured_outputs={"regex": "[0-9]+"})
    assert (guide_of(completion).kind, guide_of(completion).text) == ("regex", "[0-9]+")
    cases = {"json": (schema, "json_schema", json.dumps(schema)), "choice": (["a", "b"], "choice", '["a", "b"]'),
             "grammar": ('root ::= "x"', "ebnf_grammar", 'root ::= "x"'), "json_object": (True, "json", "")}
    for key, (value, kind, text) in cases.items():
        g = guide_of(_chat(structured_outputs={key: value}))
        assert (g.kind, g.text, g.param) == (kind, text, "structured_outputs"), key


@pytest.mark.parametrize("fields, param, words", [
    ({"response_format": {"type": "yaml"}}, "response_format", "'yaml' is not one of"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs", "structural_tag"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "non-empty list"),
    ({"guided_json": {"type": "object"}}, "guided_json", "structured_outputs.json"),
    ({"guided_regex": "a+"}, "guided_regex", "not supported"),
    ({"functions": [{"name": "f"}]}, "functions", "send tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope'"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools", "tools[0]"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tools", "only one"),
])
def test_what_cannot_be_honoured_is_a_400_naming_the_field(fields, param, words):
    with pytest.raises(OpenAIError) as err:
        guide_of(_chat(**fields))
    assert err.value.status == 400 and err.value.param == param and words in err.value.message, err.value.message


def _strict(schema, strict=True):
    return _chat(response_format={"type": "json_schema", "json_schema": {"name": "City", "schema": schema,
                                                                         "strict": strict}})


# pydantic's City.model_json_schema() (issue 51): every property required, but other keys allowed
CITY = {"properties": {"name": {"title": "Name", "type": "string"}, "country": {"title": "Country", "type": "string"},
                       "population": {"title": "Population", "type": "integer"}},
        "required": ["name", "country", "population"], "title": "City", "type": "object"}
CLOSED = {**CITY, "additionalProperties": False}  # what the openai SDK's parse() sends for City


@pytest.mark.parametrize("schema, words", [
    (CITY, 'the object at # needs "additionalProperties": false'),
    ({**CLOSED, "additionalProperties": True}, 'at # needs "additionalProperties": false'),
    ({**CLOSED, "required": ["name"]}, "missing 'country', 'population'"),
    ({**CLOSED, "properties": {**CITY["properties"], "mayor": {"$ref": "#/$defs/Person"}},
      "required": [*CITY["required"], "mayor"], "$defs": {"Person": {"type": "object", "properties": {}}}},
     "at #/$defs/Person needs"),
    ({"type": "object", "additionalProperties": False, "required": ["a"], "properties": {"a": {"anyOf": [
        {"type": "null"}, {"type": "array", "items": {"type": "object", "properties": {"b": {"type": "integer"}},
                                                       "additionalProperties": False}}]}}},
     "#/properties/a/anyOf/1/items must list every property in \"required\" (missing 'b'"),
])
def test_a_strict_schema_that_allows_more_than_openai_strict_mode_is_a_400(schema, words):
    with pytest.raises(OpenAIError) as err:
        guide_of(_strict(schema))
    assert err.value.status == 400 and err.value.param == "response_format", err.value.message
    assert "'City'" in err.value.message and words in err.value.message, err.value.message


def test_a_strict_schema_as_the_sdk_sends_it_is_followed_and_strict_false_takes_json_schema_as_it_is():
    assert json.loads(guide_of(_strict(CLOSED)).text) == CLOSED
    assert json.loads(guide_of(_strict(CITY, strict=False)).text) == CITY  # JSON Schema: other keys allowed


def test_a_strict_function_is_checked_as_a_strict_response_format():
    tools = [{"type": "function", "function": {"name": "f", "strict": True, "parameters": CITY}}]
    with pytest.raises(OpenAIError) as err:
        guide_of(_chat(tools=tools, tool_choice="required"))
    assert err.value.param == "tools" and "tools[0].function.parameters" in err.value.message
    tools[0]["function"]["parameters"] = CLOSED
    assert guide_of(_chat(tools=tools, tool_choice={"type": "function", "function": {"name": "f"}})).tool == "f"
    del tools[0]["function"]["parameters"]  # no parameters, strict: no arguments at all
    g = guide_of(_chat(tools=tools, tool_choice={"type": "function", "function": {"name": "f"}}))
    assert json.loads(g.text)["additionalProperties"] is False


def test_a_refused_guide_names_the_field_it_came_from():
    err = model_error("guided_decoding_guide: Unknown format: foo", "chat", "response_format")
    assert (err.status, err.param) == (400, "response_format") and "Unknown format: foo" in err.message


def test_tool_choice_named_and_required():
    named = guide_of(_chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    assert (named.kind, json.loads(named.text), named.tool, named.param) == ("json_schema", WEATHER, "get_weather",
                                                                             "tools")
    assert guide_of(_chat(tools=TOOLS, tool_choice="none")) is None
    required = guide_of(_chat(tools=TOOLS, tool_choice="required"))
    schema = json.loads(required.text)
    calls = [{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {}}]
    jsonschema.validate(calls, schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "other", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = json.loads(guide_of(_chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)).text)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(calls, single)
    content, whole = tool_calls(required, json.dumps(calls))
    assert content is None
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole] == \
        [("function", "get_weather", {"city": "Oslo"}), ("function", "get_time", {})]
    assert len({c["id"] for c in whole}) == 2


def _joined(deltas):
    """Streamed tool-call deltas folded by index, as OpenAI's clients fold them."""
    calls = {}
    for delta in deltas:
        for piece in delta.get("tool_calls", []):
            call = calls.setdefault(piece["index"], {"id": None, "name": None, "arguments": ""})
            call["id"] = piece.get("id") or call["id"]
            call["name"] = piece.get("function", {}).get("name") or call["name"]
            call["arguments"] += piece.get("function", {}).get("arguments", "")
    return [calls[i] for i in sorted(calls)]


def test_streamed_tool_calls_add_up_to_the_whole_ones():
    named = guide_of(_chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    stream = ToolCallStream(named)
    pieces = ['{"ci', '', 'ty": "Os', 'lo"}']
    deltas = [d for d in (stream.delta(p) for p in pieces) if d is not None] + stream.end("stop")[0]
    assert len(deltas) == 3 and sum("id" in d["tool_calls"][0] for d in deltas) == 1
    whole = tool_calls(named, "".join(pieces))[1][0]
    assert _joined(deltas) == [{"id": stream.id, "name": whole["function"]["name"],
                                "arguments": whole["function"]["arguments"]}]
    required = guide_of(_chat(tools=TOOLS, tool_choice="required"))
    text = json.dumps([{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "x"}}])
    stream = ToolCallStream(required)
    assert all(stream.delta(text[i:i + 7]) is None for i in range(0, len(text), 7))
    got = _joined(stream.end("stop")[0])
    assert [(c["name"], json.loads(c["arguments"])) for c in got] == [("get_time", {}), ("get_weather", {"city": "x"})]
    cut = ToolCallStream(required)
    cut.delta(text[:10])
    assert cut.end("length") == ([{"content": text[:10]}], False)
