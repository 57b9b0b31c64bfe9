"""The synchronous client (`Client`): each request on its own gRPC stream (tritonclient's threaded
client), tried on another replica when it fails before its first response."""

from __future__ import annotations

import uuid
from contextlib import closing
from typing import Iterator, Sequence

from llmc.client.generation import Generation, GenerationError, Unreachable, make_inputs, message, pick_model
from llmc.client.replicas import NotStarted, Replicas, as_urls, check, not_started, retryable
from llmc.client.stream import responses_sync


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
            except NotStarted as err:
                self.replicas.failed(url)
                gen.done = attempt == len(attempts) or not retryable(err.reason)
                if gen.done:
                    raise err.error from None  # else nothing was received: the other replica starts afresh

    def _run_on(self, url: str, model: str, inputs: list, gen: Generation) -> Iterator[str]:
        request, started = {"model_name": model, "inputs": inputs, "request_id": uuid.uuid4().hex}, False
        try:
            with closing(responses_sync(self._grpc, url, request, self.timeout)) as stream:
                for result, error in stream:
                    check(error, started)
                    chunk, started = gen.take(result, error), True
                    if chunk:
                        yield chunk
        except Unreachable as err:
            gen.done = True
            raise not_started(url, err, started) from None

    def close(self) -> None:  # nothing held between calls
        pass

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
