"""Chat templates: render a conversation into the prompt text a served model takes.

Rendered here, beside the CLI, and not in the served model: the model takes text (`text_input`),
so tritonclient users keep full control of their prompts, and the serving environment needs no
jinja2. The OpenAI frontend (llmc/openai/) and `llmc generate --chat` render with the template the
build recorded (runtime/manifest.py's ChatTemplate), which they read over gRPC from the model's
config.pbtxt parameter `chat_template` (JSON: template, special_tokens, source).

Templates are untrusted code (they come with checkpoints), so they run in jinja2's
ImmutableSandboxedEnvironment with the settings, filters and globals transformers gives them
(trim_blocks, lstrip_blocks, loopcontrols, a `tojson` that keeps non-ASCII, `raise_exception`,
`strftime_now`, the `{% generation %}` tag), so a template renders here as `apply_chat_template`
renders it.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

PARAMETER = "chat_template"  # the config.pbtxt parameter that carries it


class ChatTemplateError(ValueError):
    """A template that does not compile or refuses the conversation (its `raise_exception`)."""


class NoChatTemplate(ChatTemplateError):
    def __init__(self, model: str):
        super().__init__(f"model {model!r} has no chat template, so it serves completions only; give it one with "
                         f"the build spec's `serving.chat_template: PATH` (a jinja2 file) and rebuild, or use "
                         f"/v1/completions with a prompt you format yourself")


class _Generation(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}` tag (it marks assistant text for
    training masks): rendered as its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as err:
        raise ChatTemplateError(f"the chat template does not compile: {err.message} (line {err.lineno})") from None


def render(chat_template: dict, messages: list[dict], *, tools: list[dict] | None = None,
           add_generation_prompt: bool = True, **extra) -> str:
    """The prompt for `messages` (dicts with role and content); `chat_template` is the recorded
    {template, special_tokens}. Raises ChatTemplateError when the template refuses them."""
    template = compile_template(chat_template["template"])
    context = {**chat_template.get("special_tokens", {}), **extra, "messages": messages, "tools": tools,
               "add_generation_prompt": add_generation_prompt}
    try:
        return template.render(**context)
    except jinja2.exceptions.SecurityError as err:
        raise ChatTemplateError(f"the chat template tried something the sandbox forbids: {err}") from None
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as err:
        raise ChatTemplateError(f"the chat template refused the messages: {err}") from None


def parse_parameter(value: str | None) -> dict | None:
    """The config.pbtxt parameter's JSON, or None when the model has no template."""
    return json.loads(value) if value else None


def fetch(url: str, model: str) -> dict | None:
    """A served model's chat template, read over gRPC from its config (None: it has none)."""
    import tritonclient.grpc as grpc

    client = grpc.InferenceServerClient(url)
    try:
        config = client.get_model_config(model).config
    finally:
        client.close()
    return parse_parameter(config.parameters[PARAMETER].string_value if PARAMETER in config.parameters else None)


def chat_prompt(url: str, model: str, user_message: str) -> str:
    """`llmc generate --chat`: one user message rendered with the served model's template."""
    from llmc.errors import ServingError

    try:
        template = fetch(url, model)
    except Exception as err:  # tritonclient's errors: the server or the model is not there
        raise ServingError(f"{url}: cannot read {model!r}'s chat template ({err})") from None
    try:
        if template is None:
            raise NoChatTemplate(model)
        return render(template, [{"role": "user", "content": user_message}])
    except ChatTemplateError as err:
        raise ServingError(str(err)) from None
