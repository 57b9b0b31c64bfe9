"""Structured output and tool calls in the OpenAI API: what a request asks for, as the served model's
guide (runtime/decoding/grammar.py through the `guided_decoding_guide_type` / `guided_decoding_guide`
inputs), and the constrained output back as OpenAI's `tool_calls`.

    response_format      {"type": "text"} | {"type": "json_object"} | {"type": "json_schema", "json_schema":
                         {"name", "schema", "strict"}}; also on /v1/completions, as vLLM takes it
    structured_outputs   vLLM's extra: exactly one of json (a schema), regex, choice, grammar (GBNF or Lark)
                         or json_object
    tools + tool_choice  "none": the tools reach the template only; "required": the output is a JSON list
                         of one or more calls [{"name", "parameters"}] of the given functions (one with
                         parallel_tool_calls false); a named function: the output is that function's
                         arguments; "auto" (the default with tools): the model's own format, chosen from
                         its template, parsed from the output (tool_parsers.py)

Every field llmc cannot honour is a 400 naming it (never ignored); a schema the engine cannot compile
comes back from the served model and is a 400 naming the field the guide came from (protocol.py).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from llmc.openai import tool_parsers
from llmc.openai.protocol import ChatRequest, CompletionRequest, OpenAIError

# vLLM's older per-field guides and OpenAI's retired function calling: known fields llmc does not take
REFUSED_FIELDS = {
    "guided_json": "structured_outputs.json", "guided_regex": "structured_outputs.regex",
    "guided_choice": "structured_outputs.choice", "guided_grammar": "structured_outputs.grammar",
    "guided_decoding_backend": None, "guided_whitespace_pattern": None, "guided_json_object": "response_format",
    "functions": "tools", "function_call": "tool_choice",
}
_STRUCTURED_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "ebnf_grammar",
                     "json_object": "json"}


@dataclass(frozen=True)
class Guided:
    """A request's guide, the field it came from, and for a tool choice what the output means."""

    kind: str  # guided_decoding_guide_type
    text: str  # guided_decoding_guide
    param: str  # the request field a refusal names
    tool: str | None = None  # tool_choice named this function: the output is its arguments
    calls: bool = False  # tool_choice required: the output is a JSON list of {"name", "parameters"}
    auto: str | None = None  # tool_choice auto: the tool-call format parsed from the output (tool_parsers.py)
    names: frozenset = frozenset()  # the functions a call may name

    def inputs(self) -> dict:
        if not self.kind:  # tool_choice auto in the model's own format: parsed, not constrained
            return {}
        return {"guided_decoding_guide_type": self.kind, "guided_decoding_guide": self.text}

    @property
    def parses_calls(self) -> bool:
        return bool(self.tool or self.calls or self.auto)


def refuse_unknown(req: ChatRequest | CompletionRequest) -> None:
    """The fields of other APIs' structured output and function calling that llmc does not take."""
    for name in req.model_extra or {}:
        if name in REFUSED_FIELDS:
            instead = REFUSED_FIELDS[name]
            hint = f"; send {instead} instead" if instead else ""
            raise OpenAIError(400, f"{name} is not supported by llmc{hint}", name, "unsupported_parameter")


def guide_of(req: ChatRequest | CompletionRequest, template: str = "", tool_call_format: str | None = None
             ) -> Guided | None:
    """The request's guide, from response_format, structured_outputs or tools (at most one of them);
    `template`: the chat template's source (tool_choice auto reads its tool-call format from it, unless the
    build set `serving.tool_call_format`)."""
    refuse_unknown(req)
    found = [g for g in (_response_format(req.response_format), _structured(req.structured_outputs),
                         _tools(req, template, tool_call_format) if isinstance(req, ChatRequest) else None)
             if g is not None]
    if len(found) > 1:
        raise OpenAIError(400, f"{found[1].param}: only one of response_format, structured_outputs and a tool_choice "
                               f"that constrains the output may be given (also got {found[0].param})", found[1].param)
    return found[0] if found else None


def _response_format(fmt: dict | None) -> Guided | None:
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Guided("json", "", "response_format")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise OpenAIError(400, "response_format.json_schema.schema: a JSON schema object is required",
                              "response_format")
        # strict true or false: the output is constrained to the schema either way (more than OpenAI promises
        # for false); a schema the engine cannot follow exactly is refused. Strict true promises more than
        # JSON Schema says (no undeclared keys), so a schema that does not say it is refused, as OpenAI does
        if spec.get("strict") is True:
            _refuse_unless_strict(spec["schema"], f"response_format.json_schema {spec.get('name', '')!r}",
                                  "response_format")
        return Guided("json_schema", json.dumps(spec["schema"]), "response_format")
    raise OpenAIError(400, f"response_format.type: {kind!r} is not one of text, json_object, json_schema",
                      "response_format")


# JSON Schema's keywords whose values are schemas, maps of schemas or lists of them: where a schema's objects are
_SUBSCHEMA = ("additionalProperties", "additionalItems", "items", "contains", "propertyNames", "not", "if", "then",
              "else", "unevaluatedItems", "unevaluatedProperties")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_CLOSED = {"additionalProperties": False}


def _not_strict(schema: Any, where: str = "#") -> str | None:
    """Why `schema` is not strict as OpenAI's structured outputs define it (each object has additionalProperties
    false and requires every property it declares), naming the object by its JSON pointer; None if it is.
    JSON Schema itself lets an object without additionalProperties take any other key, and the grammar
    follows JSON Schema: llmc will not quietly read a strict request more loosely than OpenAI would."""
    if not isinstance(schema, dict):
        return None
    types = schema.get("type")
    if types == "object" or (isinstance(types, list) and "object" in types) or "properties" in schema:
        if schema.get("additionalProperties") is not False:
            return f"the object at {where} needs \"additionalProperties\": false"
        required = schema.get("required") or []
        missing = [k for k in schema.get("properties") or {} if k not in required]
        if missing:
            return (f"the object at {where} must list every property in \"required\" "
                    f"(missing {', '.join(map(repr, missing))}; an optional one is a union with null)")
    for key, value in schema.items():
        if key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            found = (_not_strict(v, f"{where}/{key}/{_pointer(k)}") for k, v in value.items())
        elif key in _SUBSCHEMA_LISTS and isinstance(value, list):
            found = (_not_strict(v, f"{where}/{key}/{i}") for i, v in enumerate(value))
        elif key in _SUBSCHEMA:
            found = iter([_not_strict(value, f"{where}/{key}")])
        else:
            continue
        problem = next((p for p in found if p), None)
        if problem:
            return problem
    return None


def _pointer(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _refuse_unless_strict(schema: Any, what: str, param: str) -> None:
    problem = _not_strict(schema)
    if problem:
        raise OpenAIError(400, f"Invalid schema for {what}: with strict true {problem} (OpenAI's strict mode: no "
                               "keys but the declared ones, all of them required); fix the schema or send strict "
                               "false", param)


def _structured(extra: dict | None) -> Guided | None:
    if not extra:
        return None
    unknown = sorted(set(extra) - set(_STRUCTURED_KINDS))
    if unknown:
        raise OpenAIError(400, f"structured_outputs.{unknown[0]}: not supported by llmc (it takes "
                               f"{', '.join(_STRUCTURED_KINDS)})", "structured_outputs")
    given = [k for k in _STRUCTURED_KINDS if extra.get(k) not in (None, False)]
    if len(given) != 1:
        raise OpenAIError(400, f"structured_outputs: give exactly one of {', '.join(_STRUCTURED_KINDS)} "
                               f"(got {', '.join(given) or 'none'})", "structured_outputs")
    key, value = given[0], extra[given[0]]
    if key == "json_object":
        return Guided("json", "", "structured_outputs")
    if key == "json" and isinstance(value, (dict, bool)):
        value = json.dumps(value)
    elif key == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise OpenAIError(400, "structured_outputs.choice: a non-empty list of strings", "structured_outputs")
        value = json.dumps(value)
    if not isinstance(value, str) or not value:
        raise OpenAIError(400, f"structured_outputs.{key}: a non-empty string", "structured_outputs")
    return Guided(_STRUCTURED_KINDS[key], value, "structured_outputs")


def _functions(tools: list[dict]) -> dict[str, dict]:
    """name -> parameters schema of each tool (checked: OpenAI's function tool shape)."""
    out = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise OpenAIError(400, f"tools[{i}]: a tool is {{\"type\": \"function\", \"function\": {{...}}}}", "tools")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise OpenAIError(400, f"tools[{i}].function.name: a non-empty string is required", "tools")
        strict = function.get("strict") is True
        # no parameters: no arguments (strict: not even undeclared ones)
        parameters = function.get("parameters", {"type": "object", "properties": {}, **(_CLOSED if strict else {})})
        if not isinstance(parameters, dict):
            raise OpenAIError(400, f"tools[{i}].function.parameters: a JSON schema object", "tools")
        if strict:  # the same promise as a strict response_format
            _refuse_unless_strict(parameters, f"tools[{i}].function.parameters", "tools")
        out[name] = parameters
    return out


def _tools(req: ChatRequest, template: str, tool_call_format: str | None = None) -> Guided | None:
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise OpenAIError(400, "tool_choice: needs tools", "tool_choice")
        return None
    functions = _functions(req.tools)
    if choice in (None, "auto"):
        fmt = tool_call_format or tool_parsers.detect(template)
        if fmt == "json":  # no format of its own: llmc's, described in a system message and switched on by a grammar
            return Guided("lark_grammar", tool_parsers.default_grammar(functions), "tools", auto=fmt,
                          names=frozenset(functions))
        return Guided("", "", "tools", auto=fmt, names=frozenset(functions))
    if choice == "none":
        return None
    if choice == "required":
        calls = {"anyOf": [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                            "properties": {"name": {"const": name}, "parameters": schema}}
                           for name, schema in functions.items()]}
        array = {"type": "array", "items": calls, "minItems": 1}
        if req.parallel_tool_calls is False:
            array["maxItems"] = 1
        return Guided("json_schema", json.dumps(array), "tools", calls=True)
    name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise OpenAIError(400, "tool_choice: none, auto, required or {\"type\": \"function\", \"function\": "
                               "{\"name\": ...}}", "tool_choice")
    if name not in functions:
        raise OpenAIError(400, f"tool_choice: no tool is named {name!r} (tools: {', '.join(functions)})",
                          "tool_choice")
    return Guided("json_schema", json.dumps(functions[name]), "tools", tool=name)


def tool_calls(guided: Guided, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A tool choice's complete output as (content, OpenAI's tool_calls); no calls: (text, [])."""
    if guided.tool is not None:
        return None, [_call(guided.tool, text)]
    if guided.auto is not None:
        parsed = tool_parsers.parse(guided.auto, text, set(guided.names))
        return parsed.content, [_call(name, arguments) for name, arguments in parsed.calls]
    return None, [_call(call["name"], json.dumps(call["parameters"])) for call in json.loads(text)]


def stream_for(guided: Guided):
    """The streamed form of a tool choice's output: ToolCallStream, or AutoToolStream for auto."""
    if guided.auto is not None:
        return tool_parsers.AutoToolStream(guided.auto, set(guided.names), lambda: _call("", "")["id"])
    return ToolCallStream(guided)


def _call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


class ToolCallStream:
    """One streamed choice's tool calls as OpenAI streams them: `delta.tool_calls` by index, the id and
    name once, then pieces of the arguments. A named function's arguments are the output itself, so
    they stream as they come; a required choice's list of calls is sent call by call once complete
    (the name comes before the arguments, and where one call's arguments end is known only then)."""

    def __init__(self, guided: Guided):
        self.guided, self.text, self.id = guided, "", _call("", "")["id"]

    def delta(self, text: str) -> dict | None:
        """The delta for a piece of output, or None (nothing to send yet)."""
        first = not self.text
        self.text += text
        if self.guided.tool is None or not text:
            return None
        piece: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
        if first:
            piece = {"index": 0, "id": self.id, "type": "function",
                     "function": {"name": self.guided.tool, "arguments": text}}
        return {"tool_calls": [piece]}

    def end(self, reason: str | None) -> tuple[list[dict], bool]:
        """The deltas still to send when the output ends (a required choice's calls or, cut short, its
        text as content), and whether the output was tool calls."""
        if self.guided.tool is not None:
            return [], reason == "stop"
        if reason != "stop":
            return ([{"content": self.text}] if self.text else []), False
        calls = tool_calls(self.guided, self.text)[1]
        return [{"tool_calls": [{"index": i, **call}]} for i, call in enumerate(calls)], True
