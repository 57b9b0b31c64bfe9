"""Call a served llmc model over gRPC (tritonclient): text chunks stream back as they are made.

    from llmc.client import Client
    with Client("127.0.0.1:8001") as client:
        for chunk in client.generate("The capital of France is", max_tokens=32):
            print(chunk, end="", flush=True)

`AsyncClient` is the same for asyncio (`async for chunk in client.generate(...)`). Sampling
parameters are the served model's optional inputs (`max_tokens`, `temperature`, `top_p`, `top_k`,
`min_p`, penalties, `seed`, `min_tokens`, `end_id`, `stop_words`, ...). Every failure, a refused
request, an unreachable server or a missing model, raises `GenerationError` with the server's message.
Beam search: `client.complete(prompt, beam_width=4, length_penalty=..., early_stopping=...)`
returns a Generation whose `beams`, `beam_ids` and `cum_log_probs` hold every beam, best first.
Leaving a stream early ends the request on the server in band: a stop request under the same
request id, then the stream closes with nothing pending (closing a stream with a request in flight
can crash Triton 2.51, see runtime/serving/loop.py); a server that does not answer the stop within
`STOP_SECONDS` gets its stream cancelled instead.

Several replicas: pass a list of addresses (or "host:port,host:port"). Requests start on them in
turn; one that fails before its first response is tried once more on another replica, and a
stream that fails after it ends with GenerationError (llmc/replicas.py).
"""

from __future__ import annotations

import asyncio
import queue
import time
import uuid
from typing import AsyncIterator, Iterator, Sequence

from llmc.generation import (Generation, GenerationError, ends, from_model, make_inputs, message,  # noqa: F401
                             pick_model, stop_inputs)
from llmc.replicas import Replicas, as_urls, retryable

STOP_SECONDS = 5.0  # how long leaving a stream early waits for the server to end the request


class _NotStarted(Exception):
    """The request failed before its first response: `text` is what to raise, `reason` what to judge."""

    def __init__(self, text: str, reason: str | None = None):
        super().__init__(text)
        self.text, self.reason = text, reason or text


class Client:
    """Synchronous client. Each `generate` opens its own gRPC stream, so threads may share a Client."""

    def __init__(self, url: str | Sequence[str] = "127.0.0.1:8001", model: str | None = None,
                 timeout: float | None = None):
        import tritonclient.grpc as grpc

        self._grpc, self.timeout, self._model = grpc, timeout, model
        self.replicas = Replicas(as_urls(url))
        self.url = ", ".join(self.replicas.urls)

    @property
    def model(self) -> str:
        if self._model is None:
            problems = []
            for url in self.replicas.order():
                client = self._grpc.InferenceServerClient(url)
                try:
                    index = client.get_model_repository_index().models
                except Exception as err:
                    problems.append(f"{url}: cannot reach the server ({message(err)})")
                    continue
                finally:
                    client.close()
                self._model = pick_model([m.name for m in index if m.state == "READY"], url)
                break
            else:
                raise GenerationError("; ".join(problems))
        return self._model

    def generate(self, prompt: str, stream: bool = True, gen: Generation | None = None, **params) -> Iterator[str]:
        """Yield text chunks as they arrive (one chunk when `stream` is False); pass `gen` to read
        the finish reason and ids afterwards."""
        yield from self._run(prompt, stream, params, gen if gen is not None else Generation())

    def complete(self, prompt: str, **params) -> Generation:
        """The whole result of one (non-streamed) request."""
        gen = Generation()
        for _ in self._run(prompt, False, params, gen):
            pass
        return gen

    def _run(self, prompt: str, stream: bool, params: dict, gen: Generation) -> Iterator[str]:
        inputs, model = make_inputs(self._grpc, prompt, stream, params), self.model
        attempts = self.replicas.attempts()
        for attempt, url in enumerate(attempts, 1):
            try:
                yield from self._run_on(url, model, inputs, gen)
                self.replicas.succeeded(url)
                return
            except _NotStarted as err:
                self.replicas.failed(url)
                if attempt == len(attempts) or not retryable(err.reason):
                    raise GenerationError(err.text) from None
                gen.done = False  # nothing was received: the other replica starts afresh

    def _run_on(self, url: str, model: str, inputs: list, gen: Generation) -> Iterator[str]:
        rid, responses, started = uuid.uuid4().hex, queue.Queue(), False
        client = self._grpc.InferenceServerClient(url)
        try:
            try:
                client.start_stream(callback=lambda result, error: responses.put((result, error)),
                                    stream_timeout=self.timeout)
                client.async_stream_infer(model, inputs, request_id=rid)
            except Exception as err:  # the stream broke before the request went out (server gone)
                gen.done = True
                detail = _pending_error(responses) or message(err)
                raise _NotStarted(f"{url}: {detail}") from None
            while not gen.done:
                result, error = responses.get()
                if error is not None and (not started or not from_model(error)):
                    gen.done = True
                    _fail(url, error, started)
                chunk, started = gen.take(result, error), True
                if chunk:
                    yield chunk
        finally:
            try:
                stopped = gen.done or self._stop(client, model, rid, responses)
                client.stop_stream(cancel_requests=not stopped)
            finally:
                client.close()

    def _stop(self, client, model: str, rid: str, responses: queue.Queue) -> bool:
        """End request `rid` in band (left early); whether it and the stop request both ended in time."""
        try:
            client.async_stream_infer(model, stop_inputs(self._grpc), request_id=rid)
        except Exception:
            return False
        deadline, ended = time.monotonic() + STOP_SECONDS, 0
        while ended < 2:
            try:
                ended += ends(*responses.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                return False
        return True

    def close(self) -> None:  # nothing held between calls
        pass

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _pending_error(responses: queue.Queue) -> str | None:
    """The error the stream's callback reported (tritonclient puts the cause there, not in the raise)."""
    try:
        _, error = responses.get(timeout=0.5)
    except queue.Empty:
        return None
    return message(error) if error is not None else None


def _fail(url: str, error, started: bool) -> None:
    """Raise for an error response: the model's own message as it is, a transport failure naming the
    replica; before the first response as _NotStarted (another replica may take the request)."""
    text = message(error) if from_model(error) else f"{url}: {message(error)}"
    if started:
        raise GenerationError(text)
    raise _NotStarted(text, message(error))



class AsyncClient:
    """asyncio client, one gRPC channel per replica; concurrent `generate` calls run as separate streams.
    `timeout` bounds each request (seconds), as for `Client`: a request a crashed model instance
    held then ends with an error instead of waiting forever."""

    def __init__(self, url: str | Sequence[str] = "127.0.0.1:8001", model: str | None = None,
                 timeout: float | None = None):
        import tritonclient.grpc as grpc
        import tritonclient.grpc.aio as aio

        self._grpc, self._model, self.timeout = grpc, model, timeout
        self.replicas = Replicas(as_urls(url))
        self.url = ", ".join(self.replicas.urls)
        self._clients = {u: aio.InferenceServerClient(u) for u in self.replicas.urls}
        self._client = self._clients[self.replicas.urls[0]]

    async def model(self) -> str:
        if self._model is None:
            problems = []
            for url in self.replicas.order():
                try:
                    index = (await self._clients[url].get_model_repository_index()).models
                except Exception as err:
                    problems.append(f"{url}: cannot reach the server ({message(err)})")
                    continue
                self._model = pick_model([m.name for m in index if m.state == "READY"], url)
                break
            else:
                raise GenerationError("; ".join(problems))
        return self._model

    async def generate(self, prompt: str, stream: bool = True, gen: Generation | None = None, *,
                       model: str | None = None, **params) -> AsyncIterator[str]:
        """Yield text chunks as they arrive; pass `gen` to read the finish reason and ids afterwards,
        `model` to call another model than the client's."""
        gen = gen if gen is not None else Generation()
        inputs, name = make_inputs(self._grpc, prompt, stream, params), model or await self.model()
        attempts = self.replicas.attempts()
        for attempt, url in enumerate(attempts, 1):
            inner = self._generate_on(url, name, inputs, gen)
            try:
                async for chunk in inner:
                    yield chunk
                self.replicas.succeeded(url)
                return
            except _NotStarted as err:
                self.replicas.failed(url)
                if attempt == len(attempts) or not retryable(err.reason):
                    raise GenerationError(err.text) from None
                gen.done = False  # nothing was received: the other replica starts afresh
            finally:
                await inner.aclose()  # left early: the inner stream sends its stop request now

    async def _generate_on(self, url: str, model: str, inputs: list, gen: Generation) -> AsyncIterator[str]:
        request = {"model_name": model, "inputs": inputs, "request_id": uuid.uuid4().hex}
        outgoing: asyncio.Queue = asyncio.Queue()  # this stream's requests; None half-closes it
        outgoing.put_nowait(request)

        async def requests():
            while (item := await outgoing.get()) is not None:
                yield item

        responses, started = self._clients[url].stream_infer(requests(), stream_timeout=self.timeout), False
        try:
            async for result, error in responses:
                if error is not None and (not started or not from_model(error)):
                    gen.done = True
                    _fail(url, error, started)
                chunk, started = gen.take(result, error), True
                if chunk:
                    yield chunk
                if gen.done:
                    return
            raise GenerationError(f"{url}: the stream ended before the final response")
        except (GenerationError, _NotStarted):
            raise
        except Exception as err:  # grpc errors: the server went away, the stream broke
            gen.done = True
            if not started:
                raise _NotStarted(f"{url}: {message(err)}") from None
            raise GenerationError(f"{url}: {message(err)}") from None
        finally:
            if not gen.done and not await self._stop(request, outgoing, responses):
                responses.cancel()  # no answer to the stop: cancel the stream
            outgoing.put_nowait(None)

    async def _stop(self, request: dict, outgoing: asyncio.Queue, responses) -> bool:
        """End `request` in band (left early); whether it and the stop request both ended in time."""
        outgoing.put_nowait({"model_name": request["model_name"], "inputs": stop_inputs(self._grpc),
                             "request_id": request["request_id"]})
        ended = 0
        try:
            async with asyncio.timeout(STOP_SECONDS):
                async for result, error in responses:
                    ended += ends(result, error)
                    if ended == 2:
                        return True
        except Exception:  # the timeout, or the stream broke
            pass
        return False

    @property
    def grpc(self):
        """The asyncio tritonclient of the first replica (one channel), for calls beyond generate."""
        return self._client

    async def ready(self) -> bool:
        """The server and the model are ready (on the first replica that answers so)."""
        name = await self.model()
        for client in self._clients.values():
            try:
                if await client.is_server_ready() and await client.is_model_ready(name):
                    return True
            except Exception:  # an unreachable replica: try the next
                continue
        return False

    async def complete(self, prompt: str, **params) -> Generation:
        gen = Generation()
        async for _ in self.generate(prompt, stream=False, gen=gen, **params):
            pass
        return gen

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
