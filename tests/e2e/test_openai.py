"""The OpenAI-compatible API (llmc/openai/) on a real Triton server, driven by the official `openai`
SDK (sync, async, streaming) and langchain-openai: chat through the build's chat template equal to
HF's greedy continuation, log probabilities equal to PyTorch's, every error case, disconnects that
free the KV cache, the API key, and the backends pool."""

import asyncio
import json
import shutil
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from conftest import SERVING_ENV, TINY_SERVING_SPEC, add_model_variant, byte_tokenizer, greedy_reference
from llmc.compiler.repository.triton_config import parse
from llmc.openai.server import OpenAIServer
from llmc.runtime.manifest import RepositoryManifest
from llmc.soak import llmc_metrics
from llmc.triton_server import TritonServer, assemble, free_port

pytestmark = pytest.mark.triton
# A chat template for the byte-level tiny model (plain-text markers: its vocabulary is bytes) that
# also lists the tools it is given, as tool-using templates do.
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>\n{% endfor %}"
            "{% if tools %}[tools: {{ tools | map(attribute='function.name') | join(',') }}]\n{% endif %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
BUSY = "tiny_busy"  # one KV slot and a queue of one: for busy (429) and disconnects


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
    if not (SERVING_ENV / "bin" / "python3").exists():
        pytest.skip(".venv-serving is missing: run scripts/setup.sh")
    root = tmp_path_factory.mktemp("openai")
    repository = root / "repository"
    shutil.copytree(tiny_build.repository, repository)
    shutil.copytree(chat_build.repository / "tiny_chat", repository / "tiny_chat")
    add_model_variant(repository, "tiny_chat", BUSY, max_batch_size=1, max_queue_size=1, max_seq_len=2048)
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


MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]


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
    with_tools = client.chat.completions.create(model="tiny_chat", messages=MESSAGES, tools=tools, max_tokens=4)
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


def _error(call) -> tuple[int, dict]:
    with pytest.raises(openai.APIStatusError) as info:
        call()
    return info.value.status_code, info.value.body


@pytest.mark.parametrize("kwargs, param", [
    (dict(top_p=0.0), "top_p"), (dict(temperature=-1.0), "temperature"), (dict(max_tokens=0), "max_tokens"),
    (dict(prompt="x" * 200), "prompt"), (dict(n=0), "n"), (dict(logprobs=6), "logprobs"),
    (dict(stop=["a"] * 9), "stop"), (dict(logit_bias={"1": 2.0}), "logit_bias"), (dict(prompt=[1, 2]), "prompt"),
    (dict(echo=True, logprobs=1), "logprobs"), (dict(stream_options={"include_usage": True}), "stream_options"),
])
def test_invalid_parameters_are_400_naming_the_parameter(client, kwargs, param):
    status, body = _error(lambda: client.completions.create(**{"model": "tiny", "prompt": "hi", "max_tokens": 4,
                                                                **kwargs}))
    assert status == 400 and body["param"] == param and body["message"], body


def test_streaming_refusals_are_http_errors_too(client):
    status, body = _error(lambda: client.chat.completions.create(model="tiny_chat", messages=MESSAGES, top_p=0.0,
                                                                 stream=True))
    assert status == 400 and body["param"] == "top_p"


def test_unknown_model_no_template_and_bad_messages(client):
    status, body = _error(lambda: client.completions.create(model="nope", prompt="hi"))
    assert status == 404 and body["code"] == "model_not_found" and "tiny" in body["message"]
    status, body = _error(lambda: client.chat.completions.create(model="tiny", messages=MESSAGES))
    assert status == 400 and "no chat template" in body["message"] and "serving.chat_template" in body["message"]
    status, body = _error(lambda: client.chat.completions.create(model="tiny_chat", messages=[]))
    assert status == 400 and body["param"] == "messages"
    status, body = _error(lambda: client.chat.completions.create(model="tiny_chat", messages=MESSAGES,
                                                                 top_logprobs=21, logprobs=True))
    assert status == 400 and body["param"] == "top_logprobs"


def test_malformed_and_oversized_bodies(api):
    res = httpx.post(f"{api.url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert res.status_code == 400 and "error" in res.json()
    res = httpx.post(f"{api.url}/v1/completions", json={"model": "tiny", "prompt": "x" * 100_000})
    assert res.status_code == 413 and res.json()["error"]["message"]


def _metrics(triton, model):
    return llmc_metrics(f"http://127.0.0.1:{triton.ports.metrics}", model)


def test_a_disconnect_mid_stream_stops_the_request_and_frees_the_kv_cache(api, triton):
    before = _metrics(triton, BUSY)
    long = {"model": BUSY, "prompt": "hold the slot", "max_tokens": 2000, "min_tokens": 2000, "stream": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{api.url}/v1/completions", json=long) as stream:
            assert next(line for line in stream.iter_lines() if line.startswith("data:"))
    deadline = time.monotonic() + 20  # the client left: the request ends on the server (cancelled, not finished)
    while (m := _metrics(triton, BUSY))["llmc_requests_running"] or m["llmc_kv_cache_usage_ratio"] or \
            m["llmc_request_failure_total"] == before.get("llmc_request_failure_total", 0):
        assert time.monotonic() < deadline, m
        time.sleep(0.05)
    assert m["llmc_generation_tokens_total"] - before.get("llmc_generation_tokens_total", 0) < 2000


def test_a_full_queue_is_429(api):
    async def flood():  # one slot and one queue place: most of 8 requests at once find the model busy
        async with openai.AsyncOpenAI(base_url=f"{api.url}/v1", api_key="x", max_retries=0) as aclient:
            return await asyncio.gather(*(aclient.completions.create(model=BUSY, prompt="busy", max_tokens=400,
                                                                     extra_body={"min_tokens": 400})
                                          for _ in range(8)),
                                        return_exceptions=True)

    results = asyncio.run(flood())
    busy = [r for r in results if isinstance(r, openai.RateLimitError)]
    assert busy and all(r.body["code"] == "rate_limit_exceeded" and "busy" in r.body["message"] for r in busy)
    assert all(r.usage.completion_tokens == 400 for r in results if not isinstance(r, Exception))


def test_api_key_guards_every_v1_route(triton):
    with OpenAIServer([triton.grpc_url], port=free_port(), api_key="s3cret") as server:
        for key in ("wrong", None):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions")):
                res = httpx.request(method, f"{server.url}{path}", headers=headers, json={})
                assert res.status_code == 401 and res.json()["error"]["code"] == "invalid_api_key"
        good = openai.OpenAI(base_url=f"{server.url}/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(model="tiny", prompt="hi", max_tokens=2).usage.completion_tokens == 2
        assert httpx.get(f"{server.url}/health").status_code == 200


def test_langchain_chat_openai(api, client):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=f"{api.url}/v1", api_key="x", model="tiny_chat", temperature=0, max_tokens=10,
                     max_retries=0)
    direct = client.chat.completions.create(model="tiny_chat", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=10, temperature=0).choices[0].message.content
    assert llm.invoke("hi").content == direct
    assert "".join(chunk.content for chunk in llm.stream("hi")) == direct


def test_no_server_reachable_is_503(triton):
    with OpenAIServer([f"127.0.0.1:{free_port()}"], port=free_port()) as server:
        res = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "hi"})
        assert res.status_code == 503 and res.json()["error"]["type"] == "service_unavailable"
        assert httpx.get(f"{server.url}/health").status_code == 503


def test_pool_routes_to_fewest_in_flight_and_skips_a_down_server(triton):
    from llmc.openai.backends import Pool

    async def run():
        pool = Pool([triton.grpc_url, f"127.0.0.1:{free_port()}", triton.grpc_url], health_interval=0.2)
        await pool.start()
        try:
            good, down, other = pool.backends
            assert good.healthy and other.healthy and not down.healthy
            good.in_flight = 2
            assert pool.pick("tiny")[0] is other
            good.in_flight = 0
            picks = [pool.pick("tiny")[0] for _ in range(4)]
            assert down not in picks and {id(b) for b in picks} == {id(good), id(other)}  # ties alternate
            good.healthy = False  # a failed check: skipped until the next check finds it ready
            assert all(pool.pick("tiny")[0] is other for _ in range(3))
            await asyncio.sleep(0.5)
            assert good.healthy
        finally:
            await pool.close()

    asyncio.run(run())


def test_generate_chat_renders_the_served_template(triton, client, capsys):
    from llmc.serve import generate_to

    out = []

    class Out:
        write, flush = out.append, staticmethod(lambda: None)

    generate_to(Out, "hello there", url=triton.grpc_url, model="tiny_chat", stream=True, chat=True, max_tokens=8)
    expected = client.chat.completions.create(model="tiny_chat", messages=[{"role": "user", "content": "hello there"}],
                                              max_tokens=8).choices[0].message.content
    assert "".join(out) == expected + "\n"


def test_outputs_read_in_one_pass_equal_tritonclients_as_numpy():
    """backends._Outputs (one pass, BYTES decoded by hand) gives what InferResult.as_numpy gives."""
    from tritonclient.grpc import service_pb2
    from tritonclient.grpc._infer_result import InferResult

    from llmc.openai.backends import _Outputs

    response = service_pb2.ModelInferResponse()
    for name, datatype, shape, raw in (
            ("text_output", "BYTES", [1], b"\x07\x00\x00\x00 Paris\xc3"),
            ("token_texts", "BYTES", [2], b"\x02\x00\x00\x00ab\x00\x00\x00\x00"),
            ("output_ids", "INT32", [2], np.array([42, 7], np.int32).tobytes()),
            ("top_log_probs", "FP32", [2, 3], np.arange(6, dtype=np.float32).tobytes())):
        response.outputs.add(name=name, datatype=datatype, shape=shape)
        response.raw_output_contents.append(raw)
    result = InferResult(response)
    for name in ("text_output", "token_texts", "output_ids", "top_log_probs"):
        expected, got = result.as_numpy(name), _Outputs(result).as_numpy(name)
        assert got.dtype == expected.dtype and got.shape == expected.shape and (got == expected).all(), name
    assert _Outputs(result).as_numpy("finish_reason") is None
