"""Call a served llmc model over gRPC (tritonclient): text chunks stream back as they are made.

    from llmc.client import Client
    with Client("127.0.0.1:8001") as client:
        for chunk in client.generate("The capital of France is", max_tokens=32):
            print(chunk, end="", flush=True)

`AsyncClient` is the same for asyncio (`async for chunk in client.generate(...)`). Sampling
parameters are the served model's optional inputs (`max_tokens`, `temperature`, `top_p`, `top_k`,
`min_p`, penalties, `seed`, `min_tokens`, `end_id`, `stop_words`, ...). Every failure, a refused
request, an unreachable server or a missing model, raises `GenerationError` with the server's message.
Leaving a stream early ends the request on the server in band: a stop request under the same
request id, then the stream closes with nothing pending (closing a stream with a request in flight
can crash Triton 2.51, see runtime/serving.py); a server that does not answer the stop within
`STOP_SECONDS` gets its stream cancelled instead.
"""

from __future__ import annotations

import asyncio
import queue
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterator

import numpy as np

from llmc.runtime.tensors import SCALARS

_NUMPY = {"INT32": np.int32, "UINT64": np.uint64, "FP32": np.float32, "BOOL": np.bool_}
STOP_SECONDS = 5.0  # how long leaving a stream early waits for the server to end the request
_NOT_PARAMETERS = {"stream", "stop"}  # model inputs the client sets itself


class GenerationError(RuntimeError):
    """The server refused or failed a request (its message), or could not be reached."""


@dataclass
class Generation:
    """One request's stream: iterate for text chunks; afterwards `text`, `finish_reason` and
    `output_ids` hold the whole result."""

    chunks: list[str] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_input_tokens: int | None = None  # when requested with return_num_input_tokens=True
    done: bool = False  # the final response (or an error) has arrived

    @property
    def text(self) -> str:
        return "".join(self.chunks)

    def take(self, result, error) -> str:
        """Add one streamed response and return its text; an error response raises GenerationError."""
        if error is not None:
            self.done = True
            raise GenerationError(_message(error))
        chunk = self._add(result)
        self.done = _is_final(result)
        return chunk

    def _add(self, result) -> str:
        text = result.as_numpy("text_output")
        chunk = b"".join(text.reshape(-1)).decode("utf-8") if text is not None else ""
        ids = result.as_numpy("output_ids")
        if ids is not None:
            self.output_ids += ids.reshape(-1).tolist()
        count = result.as_numpy("num_input_tokens")
        if count is not None:
            self.num_input_tokens = int(count.reshape(-1)[0])
        reason = result.as_numpy("finish_reason")
        if reason is not None:
            self.finish_reason = reason.reshape(-1)[0].decode()
        self.chunks.append(chunk)
        return chunk


def make_inputs(grpc_module, prompt: str, stream: bool, params: dict) -> list:
    """The request's input tensors; unknown parameter names raise TypeError listing the known ones."""
    def tensor(name, datatype, array):
        t = grpc_module.InferInput(name, list(array.shape), datatype)
        t.set_data_from_numpy(array)
        return t

    tensors = [tensor("text_input", "BYTES", np.array([prompt.encode("utf-8")], dtype=np.object_)),
               tensor("stream", "BOOL", np.array([stream]))]
    for name, value in params.items():
        if value is None:
            continue
        if name == "stop_words":
            words = [value] if isinstance(value, str) else list(value)
            tensors.append(tensor(name, "BYTES", np.array([w.encode("utf-8") for w in words], dtype=np.object_)))
        elif name in SCALARS and name not in _NOT_PARAMETERS:
            datatype = SCALARS[name][0]
            tensors.append(tensor(name, datatype, np.array([value], dtype=_NUMPY[datatype])))
        else:
            known = sorted(set(SCALARS) - _NOT_PARAMETERS | {"stop_words"})
            raise TypeError(f"unknown generation parameter {name!r}; known: {', '.join(known)}")
    return tensors


def stop_inputs(grpc_module) -> list:
    """A stop request's inputs (it ends the request sent under the same request id)."""
    tensors = []
    for name, datatype, value in (("text_input", "BYTES", np.array([b""], dtype=np.object_)),
                                  ("stop", "BOOL", np.array([True]))):
        tensors.append(grpc_module.InferInput(name, [1], datatype))
        tensors[-1].set_data_from_numpy(value)
    return tensors


def _ends(result, error) -> bool:
    """The response is some request's last: an error or a final response."""
    return error is not None or _is_final(result)


def _is_final(result) -> bool:
    params = result.get_response().parameters
    return "triton_final_response" in params and params["triton_final_response"].bool_param


def _pick_model(index: list[str], url: str) -> str:
    if len(index) == 1:
        return index[0]
    if not index:
        raise GenerationError(f"{url}: the server has no ready model")
    raise GenerationError(f"{url}: several models are ready ({', '.join(sorted(index))}); pass model=")


class Client:
    """Synchronous client. Each `generate` opens its own gRPC stream, so threads may share a Client."""

    def __init__(self, url: str = "127.0.0.1:8001", model: str | None = None, timeout: float | None = None):
        import tritonclient.grpc as grpc

        self._grpc, self.url, self.timeout = grpc, url, timeout
        self._model = model

    @property
    def model(self) -> str:
        if self._model is None:
            client = self._connect()
            try:
                index = client.get_model_repository_index().models
            except Exception as err:
                raise GenerationError(f"{self.url}: cannot reach the server ({_message(err)})") from None
            finally:
                client.close()
            self._model = _pick_model([m.name for m in index if m.state == "READY"], self.url)
        return self._model

    def _connect(self):
        return self._grpc.InferenceServerClient(self.url)

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
        inputs = make_inputs(self._grpc, prompt, stream, params)
        model, rid = self.model, uuid.uuid4().hex
        responses: queue.Queue = queue.Queue()
        client = self._connect()
        try:
            try:
                client.start_stream(callback=lambda result, error: responses.put((result, error)),
                                    stream_timeout=self.timeout)
                client.async_stream_infer(model, inputs, request_id=rid)
            except Exception as err:  # the stream broke before the request went out (server gone)
                gen.done = True
                raise GenerationError(f"{self.url}: {_message(err)}") from None
            while not gen.done:
                chunk = gen.take(*responses.get())
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
                ended += _ends(*responses.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                return False
        return True

    def close(self) -> None:  # nothing held between calls
        pass

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """asyncio client over one gRPC channel; concurrent `generate` calls run as separate streams.
    `timeout` bounds each request (seconds), as for `Client`: a request a crashed model instance
    held then ends with an error instead of waiting forever."""

    def __init__(self, url: str = "127.0.0.1:8001", model: str | None = None, timeout: float | None = None):
        import tritonclient.grpc as grpc
        import tritonclient.grpc.aio as aio

        self._grpc, self.url, self._model, self.timeout = grpc, url, model, timeout
        self._client = aio.InferenceServerClient(url)

    async def model(self) -> str:
        if self._model is None:
            try:
                index = (await self._client.get_model_repository_index()).models
            except Exception as err:
                raise GenerationError(f"{self.url}: cannot reach the server ({_message(err)})") from None
            self._model = _pick_model([m.name for m in index if m.state == "READY"], self.url)
        return self._model

    async def generate(self, prompt: str, stream: bool = True, gen: Generation | None = None,
                       **params) -> AsyncIterator[str]:
        """Yield text chunks as they arrive; pass `gen` to read the finish reason and ids afterwards."""
        gen = gen if gen is not None else Generation()
        request = {"model_name": await self.model(), "inputs": make_inputs(self._grpc, prompt, stream, params),
                   "request_id": uuid.uuid4().hex}
        outgoing: asyncio.Queue = asyncio.Queue()  # this stream's requests; None half-closes it
        outgoing.put_nowait(request)

        async def requests():
            while (item := await outgoing.get()) is not None:
                yield item

        responses = self._client.stream_infer(requests(), stream_timeout=self.timeout)
        try:
            async for result, error in responses:
                chunk = gen.take(result, error)
                if chunk:
                    yield chunk
                if gen.done:
                    return
            raise GenerationError(f"{self.url}: the stream ended before the final response")
        except GenerationError:
            raise
        except Exception as err:  # grpc errors: the server went away, the stream broke
            gen.done = True
            raise GenerationError(_message(err)) from None
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
                    ended += _ends(result, error)
                    if ended == 2:
                        return True
        except Exception:  # the timeout, or the stream broke
            pass
        return False

    async def ready(self) -> bool:
        """The server and the model are ready."""
        return await self._client.is_server_ready() and await self._client.is_model_ready(await self.model())

    async def complete(self, prompt: str, **params) -> Generation:
        gen = Generation()
        async for _ in self.generate(prompt, stream=False, gen=gen, **params):
            pass
        return gen

    async def close(self) -> None:
        await self._client.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def _message(err) -> str:
    return err.message() if hasattr(err, "message") and callable(err.message) else str(err)
