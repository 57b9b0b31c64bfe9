"""tool_choice auto: the model's own tool-call format, chosen from its chat template, parsed out of
its output (whole, or as a stream that sends text until a call starts and the calls once complete).

    hermes        <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks (Qwen2.5/3, Hermes)
    mistral       [TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]
    llama3_json   {"name": ..., "parameters": {...}} (after <|python_tag|> or alone; several joined by ";")
    pythonic      [get_weather(city="Oslo"), get_time()] (Llama 3.2 / 4), read with Python's ast
    json          llmc's default for a template with no tool format (SmolLM2's): the tools and the format
                  are described in a system message (DEFAULT_PROMPT), and a grammar lets the answer be
                  text not starting with "{" or exactly one call {"name": ..., "arguments": {...}} of the
                  given functions (the grammar switches on at the call's first character)

A call naming no given function leaves the output as text. Written here: no library parses these
formats outside a serving engine (vLLM's parsers are tied to its request classes).
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass

FORMATS = ("hermes", "mistral", "llama3_json", "pythonic", "json")
DEFAULT_PROMPT = ("You can call these functions:\n{tools}\nTo call one, answer with only a JSON object "
                  '{{"name": <the function\'s name>, "arguments": <its arguments as an object>}}. '
                  "Otherwise answer in plain text.")
_MARKERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3_json": "<|python_tag|>"}


def detect(template: str) -> str:
    """The tool-call format a chat template's source teaches its model."""
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "Environment: ipython" in template:
        return "llama3_json"
    if "[func_name1(" in template:
        return "pythonic"
    return "json"


def default_messages(messages: list[dict], tools: list[dict]) -> list[dict]:
    """The messages with DEFAULT_PROMPT in front (joined to a system message already there)."""
    functions = json.dumps([t["function"] for t in tools], ensure_ascii=False)
    prompt = DEFAULT_PROMPT.format(tools=functions)
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": f"{messages[0].get('content') or ''}\n\n{prompt}"}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def default_grammar(functions: dict[str, dict]) -> str:
    """The json format's Lark grammar: free text not starting with "{", or one call of a given function."""
    call = {"x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
            "anyOf": [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                       "properties": {"name": {"const": name}, "arguments": schema}}
                      for name, schema in functions.items()]}
    return f"start: TEXT | call\nTEXT: /[^{{](.|\\n)*/\ncall: %json {json.dumps(call)}\n"


@dataclass
class Parsed:
    content: str | None  # the text outside the calls (None when there is none)
    calls: list[tuple[str, str]]  # (name, arguments as JSON text)


def parse(fmt: str, text: str, names: set[str]) -> Parsed:
    """The output split into text and calls; no calls (the whole text) when any call is malformed or
    names no given function."""
    try:
        content, calls = _PARSERS[fmt](text)
    except (ValueError, SyntaxError, TypeError, KeyError, AttributeError):
        return Parsed(text, [])
    if not calls or any(name not in names for name, _ in calls):
        return Parsed(text, [])
    return Parsed(content.strip() or None, calls)


def _call(obj: dict, arguments_key: str = "arguments") -> tuple[str, str]:
    arguments = obj.get(arguments_key, obj.get("parameters", obj.get("arguments", {})))
    if isinstance(arguments, str):  # already JSON text
        json.loads(arguments)
        return obj["name"], arguments
    if not isinstance(arguments, dict):
        raise ValueError("arguments must be an object")
    return obj["name"], json.dumps(arguments, ensure_ascii=False)


def _hermes(text: str):
    blocks = re.findall(r"<tool_call>\s*(.*?)\s*</tool_call>", text, re.S)
    start = text.find("<tool_call>")
    return (text[:start] if start >= 0 else text), [_call(json.loads(b)) for b in blocks]


def _mistral(text: str):
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return text, []
    calls = json.loads(text[start + len("[TOOL_CALLS]"):].strip())
    return text[:start], [_call(c) for c in (calls if isinstance(calls, list) else [calls])]


def _llama3(text: str):
    body = text.split("<|python_tag|>", 1)[1] if "<|python_tag|>" in text else text
    if not body.lstrip().startswith("{"):
        return text, []
    return "", [_call(json.loads(part), "parameters") for part in body.split(";") if part.strip()]


def _pythonic(text: str):
    body = text.strip()
    if not (body.startswith("[") and body.endswith("]")):
        return text, []
    tree = ast.parse(body, mode="eval").body
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            raise ValueError("a pythonic call is name(keyword=value, ...)")
        arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
        calls.append((node.func.id, json.dumps(arguments, ensure_ascii=False)))
    return "", calls


def _json(text: str):
    body = text.strip()
    if not body.startswith("{"):
        return text, []
    return "", [_call(json.loads(body))]


_PARSERS = {"hermes": _hermes, "mistral": _mistral, "llama3_json": _llama3, "pythonic": _pythonic, "json": _json}


class AutoToolStream:
    """tool_choice auto, streamed: text goes out as content until a call may have started (a format's
    marker, or the opening "{" / "[" of a format without one); from there the output is held and
    parsed at the end into tool_calls deltas (or sent as content, if it held no valid call)."""

    def __init__(self, fmt: str, names: set[str], make_id):
        self.fmt, self.names, self.make_id = fmt, names, make_id
        self.text, self.sent, self.holding = "", 0, False  # all the output; how much went out as content

    def delta(self, piece: str) -> dict | None:
        """The content delta for a piece of output, or None (nothing to send yet)."""
        self.text += piece
        if self.holding:
            return None
        opening = {"json": "{", "llama3_json": "{", "pythonic": "["}.get(self.fmt)
        if opening is not None:  # a call is the whole answer: its first character says
            lead = self.text.lstrip()
            if not lead:
                return None
            if lead[0] == opening:
                self.holding = True
                return None
        marker = _MARKERS.get(self.fmt)
        end = len(self.text)
        if marker is not None:
            at = self.text.find(marker, self.sent)
            if at >= 0:
                self.holding, end = True, at
            else:  # hold back what may be the marker's beginning
                end -= next((k for k in range(min(len(marker) - 1, len(self.text)), 0, -1)
                             if marker.startswith(self.text[-k:])), 0)
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return {"content": out} if out else None

    def end(self, reason: str | None) -> tuple[list[dict], bool]:
        """The deltas still to send, and whether the output held tool calls."""
        parsed = parse(self.fmt, self.text, self.names) if reason == "stop" else Parsed(self.text, [])
        if not parsed.calls:
            rest = self.text[self.sent:]
            return ([{"content": rest}] if rest else []), False
        return [{"tool_calls": [{"index": i, "id": self.make_id(), "type": "function",
                                 "function": {"name": name, "arguments": arguments}}]}
                for i, (name, arguments) in enumerate(parsed.calls)], True
