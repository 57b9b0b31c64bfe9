"""tool_choice auto (llmc/openai/tool_parsers.py): each model family's tool-call format, chosen from
its chat template, parsed from whole outputs and from streams (text sent until a call starts, the
streamed pieces adding up to the whole answer), and llmc's default for templates with no format: a
system message describing the tools and a grammar that lets the answer be text or one valid call."""

import json

import pytest

from checkpoints import byte_tokenizer
from llmc.openai.protocol import ChatRequest
from llmc.openai.structured import guide_of
from llmc.openai.tool_parsers import AutoToolStream, default_messages, detect, parse
from llmc.runtime.decoding.grammar import Guide, GuideCompiler

NAMES = {"get_weather", "get_time"}
CASES = {
    "hermes": ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', "Let me check."),
    "mistral": ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
                '{"name": "get_time", "arguments": {}}]', None),
    "llama3_json": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
                    '{"name": "get_time", "parameters": {}}', None),
    "pythonic": ('[get_weather(city="Oslo"), get_time()]', None),
}
EXPECTED = [("get_weather", {"city": "Oslo"}), ("get_time", {})]


@pytest.mark.parametrize("fmt, template", [
    ("hermes", "{% for t in tools %}<tool_call>{{ t }}</tool_call>{% endfor %}"),
    ("mistral", "[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS][TOOL_CALLS]"),
    ("llama3_json", "Environment: ipython\n<|python_tag|>"),
    ("pythonic", "[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]"),
    ("json", "{% for m in messages %}{{ m.content }}{% endfor %}"),
])
def test_the_format_is_read_from_the_template(fmt, template):
    assert detect(template) == fmt


@pytest.mark.parametrize("fmt", list(CASES))
def test_each_format_parses_whole_and_streamed(fmt):
    text, content = CASES[fmt]
    parsed = parse(fmt, text, NAMES)
    assert parsed.content == content
    assert [(n, json.loads(a)) for n, a in parsed.calls] == EXPECTED
    for size in (1, 3, 8):
        stream = AutoToolStream(fmt, NAMES, lambda: "call_x")
        deltas = [d for d in (stream.delta(text[i:i + size]) for i in range(0, len(text), size)) if d]
        rest, called = stream.end("stop")
        assert called
        streamed_content = "".join(d.get("content", "") for d in deltas)
        assert streamed_content.strip() == (content or "")
        calls = [d["tool_calls"][0]["function"] for d in rest]
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == EXPECTED


def test_plain_answers_and_bad_calls_stay_text():
    for fmt in CASES:
        assert parse(fmt, "Just text, no call.", NAMES).calls == []
    assert parse("hermes", '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', NAMES).calls == []
    assert parse("hermes", "<tool_call>{broken</tool_call>", NAMES).content == "<tool_call>{broken</tool_call>"
    stream = AutoToolStream("hermes", NAMES, lambda: "id")
    sent = [stream.delta(p) for p in ("a <tool", "_x> b")]  # a marker's prefix is held back, then released
    assert sent == [{"content": "a "}, {"content": "<tool_x> b"}] and stream.end("stop") == ([], False)
    cut = AutoToolStream("json", NAMES, lambda: "id")
    cut.delta('{"name": "get_')
    assert cut.end("length") == ([{"content": '{"name": "get_'}], False)


def test_a_template_without_a_format_gets_llmcs_prompt_and_a_grammar_for_text_or_one_call():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]}}, "required": ["city"]}}}]
    req = ChatRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=tools)
    guided = guide_of(req, "{{ messages }}")
    assert guided.auto == "json" and guided.kind == "lark_grammar" and guided.param == "tools"
    messages = default_messages(req.messages, tools)
    assert messages[0]["role"] == "system" and '"get_weather"' in messages[0]["content"]
    compiler = GuideCompiler(byte_tokenizer(), [0], 256)
    tok = byte_tokenizer()
    for text, ok in (('{"name": "get_weather", "arguments": {"city": "Oslo"}}', True), ("Hello there", True),
                     ('{"name": "get_weather", "arguments": {"city": "Rome"}}', False),
                     ('{"name": "other", "arguments": {}}', False)):
        matcher = compiler.compile(Guide(guided.kind, guided.text))
        taken = all(matcher.allows(t, (0,)) and (matcher.consume(t) or True) for t in tok.encode(text).ids)
        assert (taken and matcher.is_accepting) == ok, text
    compiler.close()
    assert guide_of(ChatRequest(model="m", messages=req.messages, tools=tools), "<tool_call>").kind == ""


def test_the_builds_tool_call_format_overrides_the_templates():
    """`serving.tool_call_format` (carried in the chat_template parameter) picks the parser for a template
    that teaches none, or teaches another."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    req = ChatRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=tools)
    assert guide_of(req, "{{ messages }}").auto == "json"
    chosen = guide_of(req, "{{ messages }}", "hermes")
    assert chosen.auto == "hermes" and chosen.kind == ""  # parsed from free text: no grammar
