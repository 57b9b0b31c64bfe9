"""One request to a served model over a backend's asyncio gRPC channel, as text chunks.

llmc.client.AsyncClient does the same for services; the frontend needs two things it hides: which
failures the model answered (a refusal: 400/429) and which the transport had (the server is gone:
503 and the server is marked down), and no retry on another server. The request's tensors and the
responses' parsing are the client's (make_inputs, stop_inputs, Generation); leaving early ends the
request in band as the client does (a stop request under the same id, then the stream half-closes
with nothing pending; see runtime/serving/loop.py for why cancelling a gRPC call is avoided).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import AsyncIterator

from llmc.client import Generation, make_inputs, stop_inputs

STOP_SECONDS = 5.0  # how long leaving early waits for the server to end the request


class Refused(Exception):
    """The served model answered the request with an error (its message names the input at fault)."""


class Unreachable(Exception):
    """The stream broke: the server went away or never answered."""


def _text(err) -> str:
    return err.message() if hasattr(err, "message") and callable(err.message) else str(err)


def _is_final(result) -> bool:
    params = result.get_response().parameters
    return "triton_final_response" in params and params["triton_final_response"].bool_param


async def generate(client, grpc_module, model: str, prompt: str, stream: bool, gen: Generation,
                   params: dict) -> AsyncIterator[str]:
    """Text chunks of one request; `gen` gathers the responses (ids, finish reason, counts)."""
    request = {"model_name": model, "inputs": make_inputs(grpc_module, prompt, stream, params),
               "request_id": uuid.uuid4().hex}
    outgoing: asyncio.Queue = asyncio.Queue()  # this stream's requests; None half-closes it
    outgoing.put_nowait(request)

    async def requests():
        while (item := await outgoing.get()) is not None:
            yield item

    responses = client.stream_infer(requests())
    try:
        async for result, error in responses:
            if error is not None:
                gen.done = True
                raise Refused(_text(error))
            chunk = gen.take(result, None)
            if chunk:
                yield chunk
            if gen.done:
                return
        raise Unreachable("the stream ended before the final response")
    except (Refused, Unreachable):
        raise
    except Exception as err:  # grpc errors: the server went away, the stream broke
        gen.done = True
        raise Unreachable(_text(err)) from None
    finally:
        if not gen.done and not await _stop(request, outgoing, responses, grpc_module):
            responses.cancel()  # no answer to the stop: cancel the stream
        outgoing.put_nowait(None)


async def _stop(request: dict, outgoing: asyncio.Queue, responses, grpc_module) -> bool:
    """End `request` in band; whether it and the stop request both ended in time."""
    outgoing.put_nowait({"model_name": request["model_name"], "inputs": stop_inputs(grpc_module),
                         "request_id": request["request_id"]})
    ended = 0
    try:
        async with asyncio.timeout(STOP_SECONDS):
            async for result, error in responses:
                ended += error is not None or _is_final(result)
                if ended == 2:
                    return True
    except Exception:  # the timeout, or the stream broke
        pass
    return False
