"""The OpenAI-compatible API's test rig, shared by tests/e2e/openai/test_openai*.py: the tiny model with a
chat template, both built and served on a real Triton server with the OpenAI frontend in front,
and the PyTorch model the answers are checked against. conftest.py loads it as a plugin, so its
fixtures reach every test module (each module that uses them gets its own server)."""

import json
import shutil
from pathlib import Path

import openai
import pytest

from checkpoints import TINY_SERVING_SPEC
from serving_rig import SERVING_ENV, add_model_variant, serving_env
from llmc.openai.server import OpenAIServer
from llmc.triton_server import TritonServer, assemble, free_port

# A chat template for the byte-level tiny model (plain-text markers: its vocabulary is bytes) that
# also lists the tools it is given, as tool-using templates do.
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>\n{% endfor %}"
            "{% if tools %}[tools: {{ tools | map(attribute='function.name') | join(',') }}]\n{% endif %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


BUSY = "tiny_busy"  # one request at a time and a queue of one: for busy (429) and disconnects. Its KV pool
# holds a whole 2048-token request: with the pool of the model it copies (512 tokens, ~0.5 s at ~1 ms a
# token) a "long" request could end before a slow client's disconnect reached the server.


MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def chat_checkpoint(tiny_checkpoints, tmp_path_factory) -> Path:
    """The tiny Llama with a chat template in its tokenizer_config.json (as HF checkpoints carry it)."""
    folder = tmp_path_factory.mktemp("chat") / "tiny_chat"
    shutil.copytree(tiny_checkpoints["llama"], folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return folder


@pytest.fixture(scope="module")
def chat_build(chat_checkpoint, tmp_path_factory):
    from llmc.compiler import build
    from llmc.compiler.spec import parse_spec

    spec = parse_spec({"name": "tiny_chat", "source": str(chat_checkpoint), **TINY_SERVING_SPEC})
    return build(spec, output=tmp_path_factory.mktemp("chat_build") / "tiny_chat")


@pytest.fixture(scope="module")
def triton(tiny_build, chat_build, tmp_path_factory):
    serving_env()  # skips without .venv-serving
    root = tmp_path_factory.mktemp("openai")
    repository = root / "repository"
    shutil.copytree(tiny_build.repository, repository)
    shutil.copytree(chat_build.repository / "tiny_chat", repository / "tiny_chat")
    add_model_variant(repository, "tiny_chat", BUSY, max_batch_size=1, max_queue_size=1, max_seq_len=2048,
                      kv_cache_tokens=2048)
    with TritonServer(repository, server_dir=assemble(root / "server"), serving_env=SERVING_ENV,
                      log_path=root / "server.log") as srv:
        yield srv


@pytest.fixture(scope="module")
def api(triton):
    with OpenAIServer([triton.grpc_url], port=free_port(), max_body_size=64 * 1024) as server:
        yield server


@pytest.fixture(scope="module")
def client(api):
    return openai.OpenAI(base_url=f"{api.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def torch_model(tiny_checkpoints):
    from llmc.compiler.source import inspect_source, load_model
    from llmc.compiler.spec import SourceSpec

    return load_model(inspect_source(SourceSpec(path=tiny_checkpoints["llama"])))[0]


def torch_logprobs(model, prompt_ids, output_ids):
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + output_ids])).logits[0, len(prompt_ids) - 1:-1].double()
    return torch.log_softmax(logits, dim=-1).numpy()


def calls_of(message) -> list[tuple[str, dict]]:
    """A whole reply's tool calls: (name, arguments)."""
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


def streamed_calls(client, **kwargs) -> list[tuple[str, dict]]:
    """The same request streamed: its tool calls gathered from `delta.tool_calls` by index (checking the
    id and name come once, no content, and finish_reason tool_calls at the end)."""
    calls, reasons = {}, []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        choice = chunk.choices[0]
        reasons.append(choice.finish_reason)
        assert not choice.delta.content
        for piece in choice.delta.tool_calls or []:
            call = calls.setdefault(piece.index, {"id": None, "name": None, "arguments": ""})
            if piece.id:
                assert call["id"] is None  # the id and name once
                call["id"], call["name"] = piece.id, piece.function.name
            call["arguments"] += piece.function.arguments or ""
    assert reasons[-1] == "tool_calls"
    return [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]
