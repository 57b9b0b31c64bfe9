"""The in-band stream protocol (llmc/client/stream.py) that Client, AsyncClient and the OpenAI frontend
share, against fake tritonclients that serve like runtime/serving/loop.py: a request left early is
stopped by a stop request under its id on the same stream, which then closes with nothing pending
(cancelled only when the server does not answer the stop); and the errors the clients raise.
tests/e2e/test_serve_triton.py and test_openai.py run the same on a real Triton."""

import asyncio
import threading
from contextlib import aclosing, closing
from types import SimpleNamespace

import numpy as np
import pytest
import tritonclient.grpc as real_grpc

from llmc.client import AsyncClient, Client, GenerationError, Refused, Unreachable, stream


class Result:
    """A response of tritonclient's: `final` is Triton's triton_final_response flag."""

    def __init__(self, text: str = "", final: bool = False):
        self.text, self.final = text, final

    def get_response(self):
        return SimpleNamespace(parameters={"triton_final_response": SimpleNamespace(bool_param=self.final)})

    def as_numpy(self, name):
        return np.array([self.text.encode()], dtype=np.object_) if name == "text_output" else None


class ModelError(Exception):  # an error response: no gRPC status (from_model)
    def message(self):
        return str(self)


class TransportError(ModelError):  # what tritonclient raises when the stream breaks
    def status(self):
        return "StatusCode.UNAVAILABLE"


def is_stop(request) -> bool:
    return "stop" in [i.name() for i in request["inputs"]]


class Server:
    """What the fakes answer: `chunks` partial responses, then (unless `left_open`) a final one; a stop
    request ends the request it names (both send their final response) unless `deaf`; `fail` raises
    instead of the first response, or answers it with `error`."""

    def __init__(self, chunks=2, left_open=True, deaf=False, fail=None, error=None):
        self.chunks, self.left_open, self.deaf, self.fail, self.error = chunks, left_open, deaf, fail, error
        self.requests, self.cancelled, self.half_closed = [], False, False

    def answer(self, request) -> list:
        self.requests.append(request)
        if is_stop(request):
            ids = [r["request_id"] for r in self.requests[:-1] if not is_stop(r)]
            return [] if self.deaf or request["request_id"] not in ids else [(Result(final=True), None)] * 2
        if self.error is not None:
            return [(None, self.error)]
        tail = [] if self.left_open else [(Result("!", final=True), None)]
        return [(Result(f"t{i} "), None) for i in range(self.chunks)] + tail


class AioClient:
    """tritonclient.grpc.aio.InferenceServerClient's stream_infer, over a Server."""

    def __init__(self, server: Server):
        self.server = server

    def stream_infer(self, requests, stream_timeout=None):
        self.last = AioStream(self.server, requests)
        return self.last


class AioStream:
    def __init__(self, server, requests):
        self.server, self.out = server, asyncio.Queue()
        self.reader = asyncio.ensure_future(self._read(requests))

    async def _read(self, requests):
        async for request in requests:
            for response in self.server.answer(request):
                self.out.put_nowait(response)
        self.server.half_closed = True
        self.out.put_nowait(None)  # the server ends a half-closed stream

    def cancel(self):
        self.server.cancelled = True
        self.reader.cancel()
        self.out.put_nowait(CANCELLED)

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.server.fail is not None:
            await asyncio.sleep(0)
            raise self.server.fail
        try:
            response = await self.out.get()
        except asyncio.CancelledError:  # as grpc.aio's call does (_read): a cancelled read cancels the call
            self.cancel()
            raise
        if response is None:
            raise StopAsyncIteration
        if response is CANCELLED:  # as grpc.aio's read of a call cancelled meanwhile
            raise asyncio.CancelledError
        return response


CANCELLED = object()


class SyncGrpc:
    """tritonclient.grpc with its InferenceServerClient over a Server (the callback from another thread)."""

    InferInput = real_grpc.InferInput

    def __init__(self, server: Server):
        self.server = server

    def InferenceServerClient(self, url):  # noqa: N802 (tritonclient's name)
        server = self.server

        class Client:
            def start_stream(self, callback, stream_timeout=None):
                self.callback = callback

            def async_stream_infer(self, **request):
                if server.fail is not None:
                    raise server.fail
                responses = server.answer(request)  # sent in order, from tritonclient's thread
                threading.Thread(target=lambda: [self.callback(*r) for r in responses]).start()

            def stop_stream(self, cancel_requests=False):
                server.cancelled, server.half_closed = cancel_requests, True

            def close(self):
                pass

        return Client()


def request():
    return {"model_name": "m", "inputs": real_grpc_inputs(), "request_id": "r1"}


def real_grpc_inputs():
    tensor = real_grpc.InferInput("text_input", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([b"hi"], dtype=np.object_))
    return [tensor]


def run_async(server: Server, take: int) -> list:
    async def main():
        got = []
        async with aclosing(stream.responses(AioClient(server), real_grpc, request())) as responses:
            async for response in responses:
                got.append(response)
                if len(got) == take:
                    break
        await asyncio.sleep(0.01)  # the fake's reader sees the half-close
        return got
    return asyncio.run(main())


def run_sync(server: Server, take: int) -> list:
    got = []
    with closing(stream.responses_sync(SyncGrpc(server), "u", request())) as responses:
        for response in responses:
            got.append(response)
            if len(got) == take:
                break
    return got


@pytest.mark.parametrize("run", [run_async, run_sync])
def test_leaving_early_stops_the_request_under_its_id_and_closes_with_nothing_pending(run):
    server = Server(chunks=3)
    assert len(run(server, take=1)) == 1
    first, stop = server.requests
    assert not is_stop(first) and is_stop(stop) and stop["request_id"] == first["request_id"] == "r1"
    assert stop["model_name"] == "m" and server.half_closed and not server.cancelled


def test_a_caller_cancelled_while_it_waits_for_a_response_still_stops_the_request_in_band():
    """The OpenAI frontend cancels the task of a choice whose client left (llmc/openai/streaming.py): the
    request is stopped in band, as when its caller leaves between responses, not by cancelling the call."""
    server = Server(chunks=1)

    async def main():
        got = []

        async def consume():
            async with aclosing(stream.responses(AioClient(server), real_grpc, request())) as responses:
                async for response in responses:
                    got.append(response)

        task = asyncio.create_task(consume())
        while not got:
            await asyncio.sleep(0)
        await asyncio.sleep(0.01)  # the task waits for a response the server does not send
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.01)  # the fake's reader sees the half-close
        return got

    assert len(asyncio.run(main())) == 1
    assert [is_stop(r) for r in server.requests] == [False, True] and server.half_closed and not server.cancelled


def test_a_call_cancelled_under_its_read_ends_the_responses_as_unreachable():
    """The call cancelled from outside (its channel closed): the caller is told, not left waiting."""
    server = Server(chunks=1)

    async def main():
        client = AioClient(server)
        async with aclosing(stream.responses(client, real_grpc, request())) as responses:
            async for _ in responses:
                client.last.cancel()

    with pytest.raises(Unreachable, match="ended before the final response"):
        asyncio.run(asyncio.wait_for(main(), 5))
    assert [is_stop(r) for r in server.requests] == [False]


@pytest.mark.parametrize("run", [run_async, run_sync])
def test_a_finished_request_sends_no_stop(run):
    server = Server(chunks=1, left_open=False)
    assert [r.final for r, _ in run(server, take=99)] == [False, True]
    assert len(server.requests) == 1 and server.half_closed and not server.cancelled


@pytest.mark.parametrize("run", [run_async, run_sync])
def test_a_server_that_does_not_answer_the_stop_gets_the_stream_cancelled(run, monkeypatch):
    monkeypatch.setattr(stream, "STOP_SECONDS", 0.05)
    server = Server(deaf=True)
    run(server, take=1)
    assert is_stop(server.requests[-1]) and server.cancelled


@pytest.mark.parametrize("run", [run_async, run_sync])
def test_a_broken_stream_raises_unreachable_and_sends_no_stop(run, monkeypatch):
    monkeypatch.setattr(stream, "_reported", lambda pending: None)
    server = Server(fail=TransportError("connection refused"))
    with pytest.raises(Unreachable, match="connection refused"):
        run(server, take=1)
    assert not any(is_stop(r) for r in server.requests)


def collect(server: Server, which: str, take: int = 99) -> list:
    """The chunks `Client` or `AsyncClient` yields for a request to replicas a:1 and b:2 (both `server`),
    the caller leaving after `take`."""
    if which == "sync":
        client = Client("a:1,b:2", model="m")
        client._grpc = SyncGrpc(server)
        with closing(client.generate("hi")) as chunks:
            return [c for _, c in zip(range(take), chunks)]

    async def main():
        client, got = AsyncClient("a:1,b:2", model="m"), []
        client._clients = {url: AioClient(server) for url in client._clients}
        async with aclosing(client.generate("hi")) as chunks:
            async for chunk in chunks:
                got.append(chunk)
                if len(got) == take:
                    break
        await asyncio.sleep(0.01)  # the fake's reader sees the half-close
        return got
    return asyncio.run(main())


@pytest.mark.parametrize("which", ["sync", "aio"])
def test_the_clients_stop_a_stream_their_caller_leaves(which):
    server = Server(chunks=3)
    assert collect(server, which, take=2) == ["t0 ", "t1 "]
    assert [is_stop(r) for r in server.requests] == [False, True] and not server.cancelled


@pytest.mark.parametrize("which", ["sync", "aio"])
def test_the_clients_raise_refused_for_the_models_error_and_unreachable_naming_the_replica(which, monkeypatch):
    server = Server(error=ModelError("max_tokens: must be at least 1"))
    with pytest.raises(Refused, match="^max_tokens: must be at least 1$"):
        collect(server, which)
    assert len(server.requests) == 1  # not a failure another replica may fix: no retry
    monkeypatch.setattr(stream, "_reported", lambda pending: None)
    server = Server(fail=TransportError("failed to connect to all addresses"))
    with pytest.raises(Unreachable, match=r"^(a:1|b:2): failed to connect") as caught:
        collect(server, which)
    assert isinstance(caught.value, GenerationError)
