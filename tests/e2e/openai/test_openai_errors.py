"""The OpenAI-compatible API's refusals on a real Triton server: invalid parameters named (400), unknown
models and templates, malformed and oversized bodies, a full queue (429), no server reachable (503),
the API key; a disconnect mid-stream frees the KV cache; the backends pool routes around a down server."""

import asyncio
import time

import httpx
import openai
import pytest

from llmc.openai.server import OpenAIServer
from llmc.soak import llmc_metrics
from llmc.triton_server import free_port, free_ports
from openai_server import BUSY, MESSAGES

pytestmark = pytest.mark.triton


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


def test_no_server_reachable_is_503(triton):
    dead, port = free_ports(2)  # drawn together: the dead backend is never the frontend's own port
    with OpenAIServer([f"127.0.0.1:{dead}"], port=port) as server:
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
