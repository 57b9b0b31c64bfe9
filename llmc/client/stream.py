"""One request on its own Triton gRPC stream, and leaving it early in band: the protocol llmc's
clients (Client, AsyncClient) and the OpenAI frontend (llmc/openai/backends.py) share.

`responses` (tritonclient's asyncio client) and `responses_sync` (its threaded client) send one
request and yield its responses as tritonclient gives them, `(result, error)` pairs: an error the
served model answered with is one of them, and the request's last. A broken stream raises
Unreachable, as does one that ends before the request's last response. What a response means
(text, finish reason, which errors another replica may fix) is the caller's.

Leaving before the last response (the caller stops iterating and closes the generator, or raises)
ends the request on the server in band: a stop request (`stop` true) under the same request id on
the same stream, then, once the request and the stop request have both sent their last response,
the stream closes with nothing pending. Only a server that does not answer within `STOP_SECONDS`
gets its stream cancelled: cancelling a gRPC call with a request in flight can crash Triton 2.51
(runtime/serving/loop.py's docstring). Close the generators promptly (`contextlib.aclosing` /
`closing`): the stop request goes out when they close.

A request is `{"model_name": ..., "inputs": [...], "request_id": ...}`, the keyword arguments of
both tritonclients' stream calls.
"""

from __future__ import annotations

import asyncio
import queue
import time
from typing import AsyncIterator, Iterator

from llmc.client.generation import Unreachable, ends, message, stop_inputs

STOP_SECONDS = 5.0  # how long leaving a stream early waits for the server to end the request


def stop_request(grpc_module, request: dict) -> dict:
    """The stop request that ends `request`: the same model and request id."""
    return {"model_name": request["model_name"], "inputs": stop_inputs(grpc_module),
            "request_id": request["request_id"]}


async def responses(client, grpc_module, request: dict, timeout: float | None = None) -> AsyncIterator[tuple]:
    """`request`'s responses on a new stream of `client` (tritonclient.grpc.aio's), `timeout` seconds
    at most in all. The stream is read on a task of its own: grpc.aio cancels a call whose read is
    cancelled, so a caller's task cancelled mid-read (the OpenAI frontend's workers, when their client
    disconnects) would otherwise cancel the gRPC call instead of stopping the request in band."""
    outgoing: asyncio.Queue = asyncio.Queue()  # this stream's requests; None half-closes it
    outgoing.put_nowait(request)

    async def requests():
        while (item := await outgoing.get()) is not None:
            yield item

    stream, ended = client.stream_infer(requests(), stream_timeout=timeout), False
    incoming: asyncio.Queue = asyncio.Queue()  # (result, error) pairs, then what ended the stream (_read)
    reader = asyncio.ensure_future(_read(stream, incoming))
    try:
        while isinstance(item := await incoming.get(), tuple):
            ended = ends(*item)
            yield item
            if ended:
                return
        ended = True
        if item is _CLOSED:
            raise Unreachable("the stream ended before the final response")
        raise Unreachable(message(item))
    finally:
        try:
            if not ended:
                outgoing.put_nowait(stop_request(grpc_module, request))
                if not await _stopped(incoming):
                    stream.cancel()  # no answer to the stop: cancel the stream
        except asyncio.CancelledError:  # cancelled again while waiting for the stop: no more time to wait
            stream.cancel()
            raise
        finally:
            outgoing.put_nowait(None)
            _READERS.add(reader)  # it reads on to the stream's end (or its cancellation)
            reader.add_done_callback(_READERS.discard)


_CLOSED = object()  # the stream ended
_READERS: set[asyncio.Task] = set()  # readers are referenced until they end


async def _read(stream, incoming: asyncio.Queue) -> None:
    """Put the stream's responses on `incoming`, then what ended it: the exception that broke it, then _CLOSED."""
    try:
        async for pair in stream:
            incoming.put_nowait(pair)
    except Exception as err:  # grpc errors: the server went away, the stream broke
        incoming.put_nowait(err)
    finally:
        incoming.put_nowait(_CLOSED)  # also when the call was cancelled under the read (asyncio.CancelledError)


async def _stopped(incoming: asyncio.Queue) -> bool:
    """Whether the request and its stop request both sent their last response in time."""
    count = 0
    try:
        async with asyncio.timeout(STOP_SECONDS):
            while count < 2:
                item = await incoming.get()
                if not isinstance(item, tuple):  # the stream ended or broke
                    return False
                count += ends(*item)
    except TimeoutError:
        return False
    return True


def responses_sync(grpc_module, url: str, request: dict, timeout: float | None = None) -> Iterator[tuple]:
    """`request`'s responses on a new stream to the server at `url` (tritonclient.grpc's client, which
    calls back from its own thread), `timeout` seconds at most in all."""
    pending: queue.Queue = queue.Queue()
    client, ended = grpc_module.InferenceServerClient(url), False
    try:
        try:
            client.start_stream(callback=lambda result, error: pending.put((result, error)), stream_timeout=timeout)
            client.async_stream_infer(**request)
        except Exception as err:  # the stream broke before the request went out (server gone)
            ended = True
            raise Unreachable(_reported(pending) or message(err)) from None
        while not ended:
            result, error = pending.get()
            ended = ends(result, error)
            yield result, error
    finally:
        try:
            stopped = ended or _stopped_sync(client, grpc_module, request, pending)
            client.stop_stream(cancel_requests=not stopped)
        finally:
            client.close()


def _stopped_sync(client, grpc_module, request: dict, pending: queue.Queue) -> bool:
    """Send the stop request; whether the request and it both sent their last response in time."""
    try:
        client.async_stream_infer(**stop_request(grpc_module, request))
    except Exception:
        return False
    deadline, count = time.monotonic() + STOP_SECONDS, 0
    while count < 2:
        try:
            count += ends(*pending.get(timeout=max(0.0, deadline - time.monotonic())))
        except queue.Empty:
            return False
    return True


def _reported(pending: queue.Queue) -> str | None:
    """The error the stream's callback reported (tritonclient puts the cause there, not in the raise)."""
    try:
        _, error = pending.get(timeout=0.5)
    except queue.Empty:
        return None
    return message(error) if error is not None else None
