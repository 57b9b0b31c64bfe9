"""The OpenAI-compatible API (llmc/openai/) on a real Triton server, driven by the official `openai`
SDK (sync, async, streaming) and langchain-openai: chat through the build's chat template equal to
HF's greedy continuation, tools reaching the template, log probabilities equal to PyTorch's, `llmc
generate --chat`. The rig (servers, builds, fixtures): tests/openai_server.py; the refusals:
test_openai_errors.py."""

import asyncio
import json

import httpx
import numpy as np
import openai
import pytest

from checkpoints import byte_tokenizer
from serving_rig import greedy_reference
from llmc.compiler.repository.triton_config import parse
from llmc.runtime.manifest import RepositoryManifest
from openai_server import BUSY, MESSAGES, TEMPLATE, torch_logprobs

pytestmark = pytest.mark.triton


def test_the_build_carries_the_chat_template_into_manifest_and_config(chat_build, tiny_build):
    manifest = RepositoryManifest.load(chat_build.repository / "tiny_chat" / "1")
    assert manifest.chat_template.template == TEMPLATE and "checkpoint" in manifest.chat_template.source
    config = parse((chat_build.repository / "tiny_chat" / "config.pbtxt").read_text())
    assert json.loads(config.parameters["chat_template"].string_value)["template"] == TEMPLATE
    assert RepositoryManifest.load(tiny_build.repository / "tiny" / "1").chat_template is None


def test_models_and_health(client, api):
    assert {m.id for m in client.models.list()} == {"tiny", "tiny_chat", BUSY}
    assert httpx.get(f"{api.url}/health").status_code == 200


def test_greedy_chat_equals_hf_greedy_continuation_of_the_chat_template(client, chat_checkpoint, torch_model):
    from transformers import AutoTokenizer

    from llmc.chat_template import render as render_chat

    hf = AutoTokenizer.from_pretrained(chat_checkpoint)
    assert render_chat({"template": TEMPLATE}, MESSAGES) == hf.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True)
    ids = hf.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=True)["input_ids"]
    expected = greedy_reference(torch_model, list(ids), 16, end_ids=(2,))
    reply = client.chat.completions.create(model="tiny_chat", messages=MESSAGES, max_tokens=16, temperature=0)
    assert reply.choices[0].message.content == byte_tokenizer().decode([t for t in expected if t != 2])
    assert reply.choices[0].message.role == "assistant" and reply.object == "chat.completion"
    assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == len(expected)
    assert reply.choices[0].finish_reason == ("stop" if expected[-1] == 2 else "length")


def test_tools_reach_the_template(client):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    with_tools = client.chat.completions.create(model="tiny_chat", messages=MESSAGES, tools=tools, tool_choice="none",
                                                max_tokens=4)
    without = client.chat.completions.create(model="tiny_chat", messages=MESSAGES, max_tokens=4)
    assert with_tools.usage.prompt_tokens == without.usage.prompt_tokens + len("[tools: get_weather]\n")


def test_completions_sync_streaming_and_async_agree(client, api):
    whole = client.completions.create(model="tiny", prompt="The capital of France is", max_tokens=12)
    chunks = list(client.completions.create(model="tiny", prompt="The capital of France is", max_tokens=12,
                                            stream=True, stream_options={"include_usage": True}))
    assert len(chunks) > 2 and "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert whole.usage.prompt_tokens == len("The capital of France is")

    async def run():
        async with openai.AsyncOpenAI(base_url=f"{api.url}/v1", api_key="x", max_retries=0) as aclient:
            replies = await asyncio.gather(*(aclient.completions.create(
                model="tiny", prompt="The capital of France is", max_tokens=12) for _ in range(4)))
            stream = await aclient.chat.completions.create(model="tiny_chat", messages=MESSAGES, max_tokens=10,
                                                           stream=True)
            return replies, [c async for c in stream]

    replies, chat_chunks = asyncio.run(run())
    assert {r.choices[0].text for r in replies} == {whole.choices[0].text}
    assert chat_chunks[0].choices[0].delta.role == "assistant" and chat_chunks[-1].choices[0].finish_reason
    assert "".join(c.choices[0].delta.content or "" for c in chat_chunks) == client.chat.completions.create(
        model="tiny_chat", messages=MESSAGES, max_tokens=10).choices[0].message.content


def test_n_seed_stop_echo_and_prompt_lists(client):
    sampled = dict(model="tiny", prompt="pick", max_tokens=8, temperature=1.0, seed=5, n=3)
    first, again = client.completions.create(**sampled), client.completions.create(**sampled)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]  # seeded: reproducible
    assert len({c.text for c in first.choices}) > 1  # choice i runs with seed + i
    batch = client.completions.create(model="tiny", prompt=["one", "two"], max_tokens=4, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3] and batch.usage.prompt_tokens == len("one") + len("two")
    plain = client.completions.create(model="tiny", prompt="stop here", max_tokens=12).choices[0]
    stop = plain.text[3:5]
    cut = client.completions.create(model="tiny", prompt="stop here", max_tokens=12, stop=[stop]).choices[0]
    assert cut.text == plain.text[:plain.text.index(stop)] and cut.finish_reason == "stop"
    echoed = client.completions.create(model="tiny", prompt="stop here", max_tokens=12, echo=True).choices[0]
    assert echoed.text == "stop here" + plain.text and plain.finish_reason == "length"
    extra = client.completions.create(model="tiny", prompt="stop here", max_tokens=12,
                                      extra_body={"top_k": 1, "min_tokens": 12, "repetition_penalty": 1.0})
    assert extra.choices[0].text == plain.text


def test_chat_logprobs_equal_pytorch_streamed_and_whole(client, torch_model, triton):
    from llmc.client import Client

    prompt = "<system>be brief</system>\n<user>hello there</user>\n<assistant>"
    reply = client.chat.completions.create(model="tiny_chat", messages=MESSAGES, max_tokens=10, logprobs=True,
                                           top_logprobs=3, temperature=1.0, seed=3)
    content = reply.choices[0].logprobs.content
    # the same request through tritonclient (same seed, same tokens) gives the ids the API does not show
    ids = Client(triton.grpc_url, "tiny_chat").complete(prompt, max_tokens=10, temperature=1.0, seed=3).output_ids
    assert [e.token for e in content] == [byte_tokenizer().decode([i]) for i in ids]
    reference = torch_logprobs(torch_model, byte_tokenizer().encode(prompt).ids, ids)
    assert len(content) == reply.usage.completion_tokens
    assert max(abs(e.logprob - reference[i, ids[i]]) for i, e in enumerate(content)) <= 1e-3
    best = np.sort(reference, axis=1)[:, ::-1][:, :3]
    assert np.abs(np.array([[t.logprob for t in e.top_logprobs] for e in content]) - best).max() <= 1e-3
    assert content[0].bytes == list(content[0].token.encode())
    chunks = list(client.chat.completions.create(model="tiny_chat", messages=MESSAGES, max_tokens=10, logprobs=True,
                                                 top_logprobs=3, temperature=1.0, seed=3, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == [(e.token, round(e.logprob, 5)) for e in content]


def test_completion_logprobs_format(client, torch_model, triton):
    from llmc.client import Client

    reply = client.completions.create(model="tiny", prompt="offsets", max_tokens=8, logprobs=2)
    lp = reply.choices[0].logprobs
    ids = Client(triton.grpc_url, "tiny").complete("offsets", max_tokens=8).output_ids
    assert lp.tokens == [byte_tokenizer().decode([i]) for i in ids]  # each token decoded alone
    assert len(lp.token_logprobs) == 8 and lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    assert all(len(top) <= 2 and max(top.values()) >= lp.token_logprobs[i] - 1e-6 for i, top in enumerate(lp.top_logprobs))
    reference = torch_logprobs(torch_model, byte_tokenizer().encode("offsets").ids, ids)
    assert np.abs(np.array(lp.token_logprobs) - reference[np.arange(8), ids]).max() <= 1e-3


def test_langchain_chat_openai(api, client):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=f"{api.url}/v1", api_key="x", model="tiny_chat", temperature=0, max_tokens=10,
                     max_retries=0)
    direct = client.chat.completions.create(model="tiny_chat", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=10, temperature=0).choices[0].message.content
    assert llm.invoke("hi").content == direct
    assert "".join(chunk.content for chunk in llm.stream("hi")) == direct


def test_generate_chat_renders_the_served_template(triton, client, capsys):
    from llmc.serve import generate_to

    out = []

    class Out:
        write, flush = out.append, staticmethod(lambda: None)

    generate_to(Out, "hello there", url=triton.grpc_url, model="tiny_chat", stream=True, chat=True, max_tokens=8)
    expected = client.chat.completions.create(model="tiny_chat", messages=[{"role": "user", "content": "hello there"}],
                                              max_tokens=8).choices[0].message.content
    assert "".join(out) == expected + "\n"
