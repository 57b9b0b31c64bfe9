"""Control requests to a served model's LoRA adapters (runtime/serving/lora_admin.py): load (the adapter file's bytes),
unload (at once, or waiting for the requests using it), list. One request on its own stream, answered once: a JSON
result, or the model's refusal as AdapterControlError with the HTTP status it maps to (400 a bad adapter or request,
404 an unknown adapter, 409 an adapter in use). Used by `llmc adapters` and the OpenAI frontend
(llmc/fleet/adapters.py, llmc/openai/adapters.py).
"""

from __future__ import annotations

import contextlib
import json
import uuid

import numpy as np

from llmc.client.generation import GenerationError, Unreachable, from_model, message
from llmc.runtime.serving.tensors import LORA_ADAPTER, LORA_CONTROL

TIMEOUT = 660.0  # seconds: an unload may wait up to 600 s for its requests (lora_admin.MAX_WAIT)


class AdapterControlError(GenerationError):
    def __init__(self, text: str, status: int):
        super().__init__(text)
        self.status = status


def status_of(text: str) -> int:
    if text.startswith("in use:"):
        return 409
    if text.startswith(("lora_name: this model serves no adapter", "lora_task_id: no adapter")):
        return 404
    return 400


def request(grpc_module, model: str, op: dict, adapter: bytes | None = None) -> dict:
    """The stream request (tritonclient keyword arguments) for one control op on `model`."""
    tensors = [("text_input", np.array([b""], dtype=np.object_)),
               (LORA_CONTROL, np.array([json.dumps(op).encode()], dtype=np.object_))]
    if adapter is not None:
        tensors.append((LORA_ADAPTER, np.array([adapter], dtype=np.object_)))
    inputs = []
    for name, value in tensors:
        inputs.append(grpc_module.InferInput(name, [1], "BYTES"))
        inputs[-1].set_data_from_numpy(value)
    return {"model_name": model, "inputs": inputs, "request_id": f"lora-{uuid.uuid4().hex}"}


def _result(result, error) -> dict:
    if error is not None:
        text = message(error)
        if from_model(error):
            raise AdapterControlError(text, status_of(text))
        raise Unreachable(text)
    return json.loads(result.as_numpy("text_output").reshape(-1)[0])


def control_sync(url: str, model: str, op: dict, adapter: bytes | None = None, timeout: float = TIMEOUT) -> dict:
    """One control op on the server at `url` (gRPC), waited for."""
    import tritonclient.grpc as grpc

    from llmc.client.stream import responses_sync

    with contextlib.closing(responses_sync(grpc, url, request(grpc, model, op, adapter), timeout)) as answers:
        for result, error in answers:
            return _result(result, error)
    raise Unreachable(f"{url}: no answer to the adapter request")


async def control(client, model: str, op: dict, adapter: bytes | None = None, timeout: float = TIMEOUT) -> dict:
    """One control op through `client` (tritonclient.grpc.aio's), waited for."""
    import tritonclient.grpc as grpc

    from llmc.client.stream import responses

    async with contextlib.aclosing(responses(client, grpc, request(grpc, model, op, adapter), timeout)) as answers:
        async for result, error in answers:
            return _result(result, error)
    raise Unreachable("no answer to the adapter request")
