"""Chat templates (llmc/chat_template.py, compiler/repository/chat_template.py): rendered as transformers
renders them, in a sandbox; found in the checkpoint or given by the spec; broken ones fail the build."""

import json
import shutil

import pytest

from llmc.chat_template import ChatTemplateError, render
from llmc.errors import SpecError

CHATML = ("{% for m in messages %}{{ bos_token }}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MESSAGES = [{"role": "user", "content": "héllo"}, {"role": "assistant", "content": "hi"},
            {"role": "user", "content": "tools?"}]


def test_renders_like_transformers_apply_chat_template(tiny_llama):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_llama)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    template = ("{% generation %}{{ messages | tojson }}{% endgeneration %}{% for t in tools %}{% if loop.index > 5 %}"
                "{% break %}{% endif %}{{ t.function.name }}{% endfor %}" + CHATML)
    for add in (True, False):
        expected = hf.apply_chat_template(MESSAGES, tools=tools, tokenize=False, add_generation_prompt=add,
                                          chat_template=template)
        assert render({"template": template, "special_tokens": {}}, MESSAGES, tools=tools,
                      add_generation_prompt=add, bos_token=hf.bos_token or "") == expected


def test_the_sandbox_refuses_unsafe_templates_and_raise_exception_is_an_error():
    with pytest.raises(ChatTemplateError, match="sandbox"):
        render({"template": "{{ ''.__class__.__mro__[1].__subclasses__() }}"}, MESSAGES)
    with pytest.raises(ChatTemplateError, match="only user roles"):
        render({"template": "{{ raise_exception('only user roles') }}"}, MESSAGES)
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render({"template": "{% for m in messages %}"}, MESSAGES)


def test_special_tokens_reach_the_template():
    out = render({"template": CHATML, "special_tokens": {"bos_token": "<s>"}}, MESSAGES[:1])
    assert out == "<s><|im_start|>user\nhéllo<|im_end|>\n<|im_start|>assistant\n"


def test_the_spec_overrides_the_checkpoint_and_broken_templates_fail_the_build(tiny_llama, tmp_path):
    from llmc.compiler.repository.chat_template import find_chat_template
    from llmc.compiler.source import inspect_source
    from llmc.compiler.spec import SourceSpec

    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_llama, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHATML}))
    source = inspect_source(SourceSpec(path=folder))
    assert find_chat_template(source, None).template == CHATML
    override = tmp_path / "other.jinja"
    override.write_text("{{ messages[0]['content'] }}")
    found = find_chat_template(source, override)
    assert found.template == "{{ messages[0]['content'] }}" and found.source == str(override)
    override.write_text("{% if %}")
    with pytest.raises(SpecError, match="serving.chat_template"):
        find_chat_template(source, override)
    with pytest.raises(SpecError, match="serving.chat_template: cannot read"):
        find_chat_template(source, tmp_path / "missing.jinja")
    assert find_chat_template(inspect_source(SourceSpec(path=tiny_llama)), None) is None
    assert find_chat_template(source, None, tool_call_format="hermes").tool_call_format == "hermes"
    with pytest.raises(SpecError, match="serving.tool_call_format: 'hermes' needs a chat template"):
        find_chat_template(inspect_source(SourceSpec(path=tiny_llama)), None, tool_call_format="hermes")


def test_spec_paths_resolve_against_the_spec_folder(tmp_path, tiny_llama):
    from llmc.compiler.spec import load_spec
    from checkpoints import write_spec

    spec = load_spec(write_spec(tmp_path, {"name": "m", "source": str(tiny_llama),
                                           "serving": {"chat_template": "chat.jinja"}}))
    assert spec.serving.chat_template == tmp_path / "chat.jinja"


def test_an_unknown_tool_call_format_names_the_field(tiny_llama):
    from llmc.compiler.spec import parse_spec

    with pytest.raises((SpecError, ValueError), match="tool_call_format"):
        parse_spec({"name": "t", "source": str(tiny_llama), "serving": {"tool_call_format": "xml"}})
    spec = parse_spec({"name": "t", "source": str(tiny_llama), "serving": {"tool_call_format": "pythonic"}})
    assert spec.serving.tool_call_format == "pythonic"
