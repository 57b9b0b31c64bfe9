"""Structured output and tool calls through the OpenAI API on a real Triton server (the tiny random model:
whatever it writes, the engine's grammar makes it valid), driven by the official `openai` SDK and
langchain-openai: `parse()` with nested pydantic models, json_object, vLLM's structured_outputs, every
tool_choice llmc takes (streamed calls equal to whole ones), tool-result turns through the template, and
the refusals naming the field. The rig: tests/openai_server.py."""

import json
import re
from enum import Enum
from typing import Literal, Optional, Union

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from openai_server import BUSY, MESSAGES, calls_of, streamed_calls

pytestmark = [pytest.mark.triton, pytest.mark.slow]
LONG = BUSY  # tiny_chat with room for long outputs (max_seq_len 2048; one request at a time)

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"enum": ["Oslo", "Lima"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string", "maxLength": 5}}, "required": ["zone"],
             "additionalProperties": False}}}]


class Size(str, Enum):
    small = "S"
    large = "L"


class Part(BaseModel):
    name: str = Field(max_length=5)
    count: int = Field(ge=0, le=99)


class Order(BaseModel):
    id: int = Field(ge=0, le=999)
    size: Size
    parts: list[Part] = Field(max_length=2)
    note: Optional[str] = Field(max_length=4)
    kind: Union[Literal["new", "old"], bool]


def _error(call) -> dict:
    with pytest.raises(openai.APIStatusError) as info:
        call()
    assert info.value.status_code == 400
    return info.value.body


def test_parse_with_nested_pydantic_models(client):
    completion = client.chat.completions.parse(model=LONG, messages=MESSAGES, response_format=Order, max_tokens=300)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    order = choice.message.parsed
    assert isinstance(order, Order) and isinstance(order.size, Size) and all(isinstance(p, Part) for p in order.parts)
    assert Order.model_validate_json(choice.message.content) == order


def test_json_object_and_structured_outputs(client):
    reply = client.chat.completions.create(model="tiny_chat", messages=MESSAGES, max_tokens=60,
                                           response_format={"type": "json_object"})
    text = reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "length" or isinstance(json.loads(text), dict)
    assert text.startswith("{")
    extras = {"regex": ({"regex": "[A-Z][a-z]{2,5} [0-9]{2}"}, lambda s: re.fullmatch(r"[A-Z][a-z]{2,5} [0-9]{2}", s)),
              "choice": ({"choice": ["alpha", "beta"]}, lambda s: s in ("alpha", "beta")),
              "grammar": ({"grammar": 'root ::= "<" ("x" | "y")+ ">"'}, lambda s: re.fullmatch(r"<[xy]+>", s)),
              "json": ({"json": WEATHER}, lambda s: jsonschema.validate(json.loads(s), WEATHER) is None)}
    for name, (extra, ok) in extras.items():
        reply = client.completions.create(model="tiny", prompt="answer:", max_tokens=40,
                                          extra_body={"structured_outputs": extra})
        assert reply.choices[0].finish_reason == "stop" and ok(reply.choices[0].text), (name, reply.choices[0].text)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_tool_choice_constrains_to_the_functions_and_streams_equal_whole(client, tool_choice):
    kwargs = dict(model=LONG, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, max_tokens=300)
    reply = client.chat.completions.create(**kwargs)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = calls_of(choice.message)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for name, arguments in calls:
        jsonschema.validate(arguments, schemas[name])
    if tool_choice != "required":
        assert [name for name, _ in calls] == ["get_weather"]
    assert all(c.id.startswith("call_") and c.type == "function" for c in choice.message.tool_calls)
    assert streamed_calls(client, **kwargs) == calls  # greedy: the same calls, streamed by index
    one = client.chat.completions.create(**{**kwargs, "parallel_tool_calls": False})
    assert len(one.choices[0].message.tool_calls) == 1


def test_tool_choice_none_and_tool_result_turns_render_through_the_template(client):
    plain = client.chat.completions.create(model=LONG, messages=MESSAGES, max_tokens=4)
    none = client.chat.completions.create(model=LONG, messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                          max_tokens=4)
    assert none.choices[0].message.tool_calls is None
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens + len("[tools: get_weather,get_time]\n")
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Oslo", "days": 2}'}}
    turns = MESSAGES + [{"role": "assistant", "content": "", "tool_calls": [call]},
                        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    after = client.chat.completions.create(model=LONG, messages=turns, tools=TOOLS, tool_choice="none",
                                           max_tokens=4)
    # the template renders each turn as <role>content</role>: the assistant's and the tool's turns were rendered
    assert after.usage.prompt_tokens == none.usage.prompt_tokens + len("<assistant></assistant>\n<tool>sunny</tool>\n")


def test_tool_choice_auto_on_a_template_without_a_format_answers_text_or_a_valid_call(client):
    """The tiny template has no tool format: llmc's default (a system message, a grammar switched on by
    the answer's first character). Sampled answers are either text or a call valid for its schema,
    whole and streamed alike."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {  # short: the prompt describes it
        "type": "object", "properties": {"n": {"enum": [1, 2]}}, "required": ["n"], "additionalProperties": False}}}]
    schemas = {"f": tools[0]["function"]["parameters"]}
    for seed in range(6):
        kwargs = dict(model=LONG, messages=[{"role": "user", "content": "hi"}], tools=tools, max_tokens=60,
                      temperature=1.0, seed=seed)
        choice = client.chat.completions.create(**kwargs).choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            (name, arguments), = calls_of(choice.message)
            jsonschema.validate(arguments, schemas[name])
            assert streamed_calls(client, **kwargs) == [(name, arguments)]
        else:
            assert not choice.message.content.lstrip().startswith("{")
            streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
                stream=True, **kwargs))
            assert streamed == choice.message.content


def test_what_cannot_be_honoured_is_a_400_naming_the_field(client):
    chat = dict(model="tiny_chat", messages=MESSAGES, max_tokens=8)
    body = _error(lambda: client.chat.completions.create(**chat, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "format": "no-such"}}}))
    assert body["param"] == "response_format" and "no-such" in body["message"]
    body = _error(lambda: client.chat.completions.create(**chat, stream=True, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}))
    assert body["param"] == "response_format"
    body = _error(lambda: client.chat.completions.create(**chat, tools=TOOLS, tool_choice={"type": "function",
                                                                                            "function": {"name": "x"}}))
    assert body["param"] == "tool_choice" and "'x'" in body["message"]
    body = _error(lambda: client.completions.create(model="tiny", prompt="x", extra_body={"guided_regex": "a+"}))
    assert body["param"] == "guided_regex"
    body = _error(lambda: client.completions.create(model="tiny", prompt="x",
                                                    extra_body={"structured_outputs": {"regex": "a(("}}))
    assert body["param"] == "structured_outputs" and "a((" in body["message"]


def test_langchain_structured_output_and_bound_tools(api):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=f"{api.url}/v1", api_key="x", model=LONG, temperature=0, max_tokens=300,
                     max_retries=0)
    order = llm.with_structured_output(Order, method="json_schema", strict=True).invoke("an order")
    assert isinstance(order, Order)
    message = llm.bind_tools([TOOLS[0]], tool_choice="get_weather").invoke("weather?")
    assert [c["name"] for c in message.tool_calls] == ["get_weather"]
    jsonschema.validate(message.tool_calls[0]["args"], WEATHER)
    forced = llm.bind_tools(TOOLS, tool_choice="any").invoke("weather or time?")
    assert forced.tool_calls and {c["name"] for c in forced.tool_calls} <= {"get_weather", "get_time"}
