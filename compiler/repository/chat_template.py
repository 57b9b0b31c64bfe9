"""The chat template a build carries into its repository: the checkpoint's own (transformers reads
`chat_template` from tokenizer_config.json, chat_template.jinja, or a GGUF's metadata), or the file
the spec's `serving.chat_template` names instead. It is checked to compile (in the same sandbox that
renders it, llmc/chat_template.py) so a broken one fails the build, not the first chat request.
"""

from __future__ import annotations

from pathlib import Path

from llmc.chat_template import ChatTemplateError, compile_template
from llmc.compiler.source import SourceInfo, load_tokenizer
from llmc.errors import SpecError
from llmc.runtime.manifest import ChatTemplate


def find_chat_template(source: SourceInfo, override: Path | None, tokenizer=None,
                       tool_call_format: str | None = None) -> ChatTemplate | None:
    """The template to serve (None: the model serves completions only); `tokenizer`: the source's, when
    the caller has loaded it already; `tool_call_format`: the spec's `serving.tool_call_format`."""
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(source)
    if override is not None:
        try:
            template, origin = Path(override).read_text(encoding="utf-8"), str(override)
        except (OSError, UnicodeDecodeError) as err:
            raise SpecError(f"serving.chat_template: cannot read {override}: {err}") from None
        field = "serving.chat_template"
    else:
        template, origin, field = _checkpoint_template(tokenizer), f"{source.path} (the checkpoint)", "the checkpoint's"
        if template is None:
            if tool_call_format is not None:
                raise SpecError(f"serving.tool_call_format: {tool_call_format!r} needs a chat template, and "
                                f"{source.path} has none; give one with serving.chat_template")
            return None
    try:
        compile_template(template)
    except ChatTemplateError as err:
        raise SpecError(f"{field} chat template ({origin}): {err}") from None
    special = getattr(tokenizer, "special_tokens_map", {}) if tokenizer is not None else {}
    return ChatTemplate(template=template, source=origin, tool_call_format=tool_call_format,
                        special_tokens={k: v for k, v in special.items() if isinstance(v, str)})


def _checkpoint_template(tokenizer) -> str | None:
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    if isinstance(template, dict):  # several named templates: the default one
        template = template.get("default")
    return template or None
