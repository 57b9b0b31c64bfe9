"""The asyncio client (`AsyncClient`): one gRPC channel per replica (tritonclient's asyncio client),
each request on its own stream of it, tried on another replica when it fails before its first
response."""

from __future__ import annotations

import uuid
from contextlib import aclosing
from typing import AsyncIterator, Sequence

from llmc.client.generation import Generation, GenerationError, Unreachable, make_inputs, message, pick_model
from llmc.client.replicas import NotStarted, Replicas, as_urls, check, not_started, retryable
from llmc.client.stream import responses


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
            try:
                async with aclosing(self._generate_on(url, name, inputs, gen)) as chunks:  # left early: the stop
                    async for chunk in chunks:
                        yield chunk
                self.replicas.succeeded(url)
                return
            except NotStarted as err:
                self.replicas.failed(url)
                gen.done = attempt == len(attempts) or not retryable(err.reason)
                if gen.done:
                    raise err.error from None  # else nothing was received: the other replica starts afresh

    async def _generate_on(self, url: str, model: str, inputs: list, gen: Generation) -> AsyncIterator[str]:
        request, started = {"model_name": model, "inputs": inputs, "request_id": uuid.uuid4().hex}, False
        try:
            async with aclosing(responses(self._clients[url], self._grpc, request, self.timeout)) as stream:
                async for result, error in stream:
                    check(error, started)
                    chunk, started = gen.take(result, error), True
                    if chunk:
                        yield chunk
        except Unreachable as err:
            gen.done = True
            raise not_started(url, err, started) from None

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
