"""The packaged tiny model on a real Triton server: parity with PyTorch, streaming, batching,
cancellation, HTTP endpoints and every bad-input case, all on one server started by a fixture."""

import asyncio
import json
import shutil
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from checkpoints import byte_tokenizer
from serving_rig import SERVING_ENV, add_model_variant, greedy_reference, serving_env
from llmc.client import AsyncClient, Client, Generation, GenerationError
from llmc.client import stream as client_stream
from llmc.soak import llmc_metrics
from llmc.triton_server import TritonServer, assemble

pytestmark = pytest.mark.triton
ONE_SLOT = "tiny_one_slot"  # one KV slot, a queue of one and long contexts: for queueing and cancelling


@pytest.fixture(scope="module")
def server(tiny_build, tmp_path_factory):
    serving_env()  # skips without .venv-serving
    root = tmp_path_factory.mktemp("serve")
    repository = root / "repository"
    shutil.copytree(tiny_build.repository, repository)
    add_model_variant(repository, "tiny", ONE_SLOT, max_batch_size=1, max_queue_size=1, max_seq_len=2048,
                      kv_cache_tokens=2048)
    with TritonServer(repository, server_dir=assemble(root / "server"), serving_env=SERVING_ENV,
                      log_path=root / "server.log") as srv:
        yield srv


@pytest.fixture(scope="module")
def torch_model(tiny_checkpoints):
    from llmc.compiler.source import inspect_source, load_model
    from llmc.compiler.spec import SourceSpec

    return load_model(inspect_source(SourceSpec(path=tiny_checkpoints["llama"])))[0]


def _metrics(server, model: str) -> dict[str, float]:
    return llmc_metrics(f"http://127.0.0.1:{server.ports.metrics}", model)


def test_greedy_output_equals_pytorch(server, torch_model):
    client = Client(server.grpc_url, "tiny")
    for prompt in ("hello there", "The capital of France is"):
        gen = client.complete(prompt, max_tokens=20)
        assert gen.output_ids == greedy_reference(torch_model, byte_tokenizer().encode(prompt).ids, 20, end_ids=(2,))
        assert gen.finish_reason in ("length", "stop")


def test_triton_serves_the_config_as_packaged(server):
    """Triton runs with auto-completion off (llmc.triton_server.NO_AUTO_COMPLETE): what it serves is what the
    package wrote, nothing inferred, so the written config must be whole."""
    import tritonclient.grpc as grpcclient

    from llmc.compiler.repository.triton_config import parse

    served = grpcclient.InferenceServerClient(server.grpc_url).get_model_config("tiny").config
    written = parse((server.repository / "tiny" / "config.pbtxt").read_text())
    for field in ("input", "output", "max_batch_size", "model_transaction_policy", "parameters", "backend"):
        assert getattr(served, field) == getattr(written, field), field
    assert [(g.count, g.kind) for g in served.instance_group] == [(g.count, g.kind) for g in written.instance_group]


def test_streamed_text_concatenated_equals_the_non_streamed_text(server):
    client = Client(server.grpc_url, "tiny")
    chunks = list(client.generate("stream me", max_tokens=24))
    whole = client.complete("stream me", max_tokens=24)
    assert len(chunks) > 1 and "".join(chunks) == whole.text


def test_32_concurrent_mixed_requests_each_equal_their_solo_result(server):
    requests = [dict(prompt=f"request {i} " + "abc" * (i % 7), max_tokens=4 + (i * 5) % 37, stream=i % 2 == 0,
                     **({"temperature": 0.8, "seed": i} if i % 4 == 3 else {})) for i in range(32)]

    async def run(reqs, concurrently):
        async with AsyncClient(server.grpc_url, "tiny") as client:
            async def one(r):
                gen = Generation()
                r = dict(r)
                async for _ in client.generate(r.pop("prompt"), r.pop("stream"), gen, **r):
                    pass
                return gen
            if concurrently:
                return await asyncio.gather(*[one(r) for r in reqs])
            return [await one(r) for r in reqs]

    solo = asyncio.run(run(requests, concurrently=False))
    together = asyncio.run(run(requests, concurrently=True))
    for r, a, b in zip(requests, solo, together):
        assert b.finish_reason in ("length", "stop")
        if "temperature" not in r:
            assert (b.output_ids, b.text) == (a.output_ids, a.text), r
    assert _metrics(server, "tiny")["llmc_requests_running"] == 0


@pytest.mark.parametrize("in_band", [True, False], ids=["stop-request", "stream-cancelled"])
def test_leaving_a_stream_early_frees_the_slot(server, monkeypatch, in_band):
    stops = []
    stopped = client_stream._stopped_sync

    def spy(*args):  # in band: the server must answer the stop; else: the gRPC stream is cancelled
        stops.append(stopped(*args) if in_band else False)
        return stops[-1]

    monkeypatch.setattr(client_stream, "_stopped_sync", spy)
    client = Client(server.grpc_url, ONE_SLOT)
    before = _metrics(server, ONE_SLOT).get("llmc_request_failure_total", 0)
    stream = client.generate("a long one", max_tokens=2000, min_tokens=2000)
    next(stream)
    assert _metrics(server, ONE_SLOT)["llmc_requests_running"] == 1
    stream.close()  # leaves the stream early: the request ends on the server
    assert stops == [in_band]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        m = _metrics(server, ONE_SLOT)
        if m["llmc_requests_running"] == 0 and m["llmc_request_failure_total"] > before:
            break
        time.sleep(0.1)
    assert m["llmc_requests_running"] == 0 and m["llmc_kv_cache_usage_ratio"] == 0
    assert m["llmc_request_failure_total"] == before + 1
    assert client.complete("next", max_tokens=3).finish_reason == "length"  # the slot serves again


def test_an_async_stream_left_early_is_stopped_in_band(server, monkeypatch):
    from llmc.client import AsyncClient

    stops = []
    stopped = client_stream._stopped

    async def spy(*args):
        stops.append(await stopped(*args))
        return stops[-1]

    monkeypatch.setattr(client_stream, "_stopped", spy)

    async def leave_early():
        async with AsyncClient(server.grpc_url, ONE_SLOT) as client:
            stream = client.generate("a long one", max_tokens=2000, min_tokens=2000)
            await stream.__anext__()
            await stream.aclose()
            return await client.complete("next", max_tokens=3)

    assert asyncio.run(leave_early()).finish_reason == "length" and stops == [True]  # the slot was freed at once
    assert _metrics(server, ONE_SLOT)["llmc_requests_running"] == 0


def _post(server, endpoint: str, body: dict):
    req = urllib.request.Request(f"http://{server.http_url}/v2/models/tiny/{endpoint}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.read().decode()


def test_http_generate_and_generate_stream(server):
    whole = json.loads(_post(server, "generate", {"text_input": "over http", "max_tokens": 12}))
    events = [json.loads(line[len("data: "):]) for line in
              _post(server, "generate_stream", {"text_input": "over http", "max_tokens": 12, "stream": True}).splitlines()
              if line.startswith("data: ")]
    assert len(events) > 1 and "".join(e["text_output"] for e in events) == whole["text_output"]
    assert events[-1]["finish_reason"] == whole["finish_reason"]
    with pytest.raises(urllib.error.HTTPError) as err:
        _post(server, "generate", {"text_input": "x", "top_p": 1.5})
    assert "top_p" in json.loads(err.value.read())["error"]


def _raw(server, tensors: list[tuple[str, str, np.ndarray]], model: str = "tiny") -> str:
    """Send hand-made input tensors; return the error message (the request must fail)."""
    import queue

    import tritonclient.grpc as grpc

    inputs = []
    for name, datatype, array in tensors:
        t = grpc.InferInput(name, list(array.shape), datatype)
        t.set_data_from_numpy(array)
        inputs.append(t)
    client, answers = grpc.InferenceServerClient(server.grpc_url), queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put(error))
    try:
        client.async_stream_infer(model, inputs)
        error = answers.get(timeout=30)
    finally:
        client.stop_stream()
        client.close()
    assert error is not None, "the request succeeded"
    return error.message()


TEXT = ("text_input", "BYTES", np.array([b"hi"], dtype=object))


@pytest.mark.parametrize("case, tensors, expected", [
    ("missing text_input", [("max_tokens", "INT32", np.array([4], dtype=np.int32))], "text_input"),
    ("wrong dtype", [TEXT, ("temperature", "INT32", np.array([1], dtype=np.int32))], "temperature"),
    ("wrong shape", [("text_input", "BYTES", np.array([b"a", b"b"], dtype=object))], "text_input"),
    ("negative temperature", [TEXT, ("temperature", "FP32", np.array([-0.5], dtype=np.float32))], "temperature"),
    ("top_p zero", [TEXT, ("top_p", "FP32", np.array([0.0], dtype=np.float32))], "top_p"),
    ("top_p above one", [TEXT, ("top_p", "FP32", np.array([1.01], dtype=np.float32))], "top_p"),
    ("max_tokens zero", [TEXT, ("max_tokens", "INT32", np.array([0], dtype=np.int32))], "max_tokens"),
    ("max_tokens above the limit", [TEXT, ("max_tokens", "INT32", np.array([129], dtype=np.int32))], "max_tokens"),
    ("prompt longer than max_seq_len", [("text_input", "BYTES", np.array([b"x" * 200], dtype=object))], "text_input"),
    ("invalid UTF-8", [("text_input", "BYTES", np.array([b"\xff\xfe hi"], dtype=object))], "UTF-8"),
    ("too many stop words", [TEXT, ("stop_words", "BYTES", np.array([b"s"] * 9, dtype=object))], "stop_words"),
])
def test_bad_input_gets_an_error_naming_it(server, case, tensors, expected):
    assert expected in _raw(server, tensors)


def test_guided_requests_through_the_client_and_raw_tritonclient(server):
    """The guide's inputs, TensorRT-LLM's names: through llmc's client (a schema given as a dict) and as
    hand-made tensors; a guide that does not compile is refused naming the input, others go on."""
    schema = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                               "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                                        "maxItems": 2}},
              "required": ["id", "tags"], "additionalProperties": False}
    client = Client(server.grpc_url, "tiny")
    gen = client.complete("give json", max_tokens=60, guided_decoding_guide_type="json_schema",
                          guided_decoding_guide=schema)
    value = json.loads(gen.text)
    assert set(value) == {"id", "tags"} and 0 <= value["id"] <= 999 and gen.finish_reason == "stop"
    streamed = "".join(client.generate("pick", guided_decoding_guide_type="choice",
                                       guided_decoding_guide=json.dumps(["red", "green", "blue"])))
    assert streamed in ("red", "green", "blue")
    message = _raw(server, [TEXT, ("guided_decoding_guide_type", "BYTES", np.array([b"json_schema"], dtype=object)),
                            ("guided_decoding_guide", "BYTES", np.array([b'{"type": "nope"}'], dtype=object))])
    assert message.startswith("guided_decoding_guide: ") and "nope" in message
    message = _raw(server, [TEXT, ("guided_decoding_guide_type", "BYTES", np.array([b"xml"], dtype=object))])
    assert message.startswith("guided_decoding_guide_type: 'xml' is not one of")


def test_bad_requests_do_not_disturb_one_in_flight(server):
    client = Client(server.grpc_url, "tiny")
    solo = client.complete("steady", max_tokens=60)
    stream = client.generate("steady", max_tokens=60)
    chunks = [next(stream)]
    for _ in range(5):
        _raw(server, [TEXT, ("top_p", "FP32", np.array([2.0], dtype=np.float32))])
    chunks += list(stream)
    assert "".join(chunks) == solo.text
    assert urllib.request.urlopen(f"http://{server.http_url}/v2/health/ready").status == 200


def test_a_full_queue_answers_busy_retry(server):
    async def flood():
        async with AsyncClient(server.grpc_url, ONE_SLOT) as client:
            async def one(i):
                try:
                    # long enough that the four arrive while the first still holds the slot (300
                    # tokens of the tiny model once finished before the fourth request came)
                    return (await client.complete(f"flood {i}", max_tokens=2000, min_tokens=2000)).finish_reason
                except GenerationError as err:
                    return str(err)
            return await asyncio.gather(*[one(i) for i in range(4)])

    answers = asyncio.run(flood())  # one slot, one queued: at least two of four are refused
    assert sum(a.startswith("busy, retry") for a in answers) >= 2, answers
    assert all(a == "length" or a.startswith("busy, retry") for a in answers), answers
