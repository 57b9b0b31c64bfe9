"""The Triton servers behind the OpenAI frontend: one gRPC channel each (llmc.client.AsyncClient
over tritonclient's asyncio client), health-checked in the background, picked by fewest requests
in flight.

- A server that answers not ready, or fails UNHEALTHY_AFTER health checks in a row (unreachable, or slower than
  HEALTH_TIMEOUT), is skipped until a later check finds it ready again; one whose stream breaks is marked down at
  once. A single slow check does not: on a busy host one answer past the timeout made every request 503 until
  the next check, with the server up.
- A request goes to the server with the fewest in flight among those serving its model (ties:
  the one picked least often). A stream stays on its server; nothing is retried silently: a
  server that fails mid-request answers 503.
- The models are those READY on the healthy servers; each model's chat template comes from its
  config.pbtxt parameter (llmc/chat_template.py), read once per model version, and so do the LoRA adapters it
  serves (the `lora_adapters` parameter, docs/lora.md): a request names one as its `model` and goes to the model
  that serves it with `lora_name` (`resolve`). A model's own name wins over an adapter of another model. A model
  serving adapters is asked for its current list at each check (adapters are loaded and unloaded while it serves:
  llmc/openai/adapters.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from dataclasses import dataclass, replace
from typing import AsyncIterator

import numpy as np

from llmc.chat_template import PARAMETER, parse_parameter
from llmc.client import Generation, Unreachable, make_inputs
from llmc.client.adapters import AdapterControlError, control
from llmc.client.stream import responses
from llmc.runtime.serving.tensors import ADAPTERS_PARAMETER as ADAPTERS
from llmc.runtime.serving.tensors import LORA_CONTROL
from llmc.openai.protocol import OpenAIError

HEALTH_INTERVAL = 2.0  # seconds between health checks
HEALTH_TIMEOUT = 2.0
UNHEALTHY_AFTER = 2  # failed checks in a row that mark a server down (the first of them keeps what it knew)


@dataclass(frozen=True)
class ModelInfo:
    name: str
    version: str
    chat_template: dict | None
    inputs: frozenset[str] | None = None  # the input tensors the model declares (None: not known)
    adapters: tuple[str, ...] = ()  # the LoRA adapters it serves (config.pbtxt's lora_adapters parameter)
    lora: bool = False  # it serves adapters: their list is asked for at each check (loaded at run time)


class ChoiceGeneration(Generation):
    """One choice's stream: the client's Generation plus the usage counts and the log probabilities
    (runtime/decoding/logprobs.py's outputs)."""

    def __init__(self):
        super().__init__()
        self.num_output_tokens: int | None = None
        self.logprobs: list[dict] = []  # not yet taken: {"token", "logprob", "top": [(token, logprob)]}

    def _add(self, result) -> str:
        result = _Outputs(result)
        chunk = super()._add(result)
        count = result.as_numpy("num_output_tokens")
        if count is not None:
            self.num_output_tokens = int(count.reshape(-1)[0])
        values = result.as_numpy("output_log_probs")
        if values is not None:
            texts = [t.decode("utf-8") for t in result.as_numpy("token_texts").reshape(-1)]
            top_values, top_texts = result.as_numpy("top_log_probs"), result.as_numpy("top_token_texts")
            for i, (text, value) in enumerate(zip(texts, values.reshape(-1).tolist())):
                top = [] if top_values is None else [(t.decode("utf-8"), float(v))
                                                     for t, v in zip(top_texts[i], top_values[i])]
                self.logprobs.append({"token": text, "logprob": float(value), "top": top})
        return chunk

    def take_logprobs(self) -> list[dict]:
        taken, self.logprobs = self.logprobs, []
        return taken


class _Outputs:
    """A response's outputs by name, read once: tritonclient's InferResult.as_numpy scans every output
    for each name it is asked, and decodes BYTES through a general numpy routine; a streamed response
    is asked for up to seven outputs, once per token. BYTES are Triton's serialization (each element
    a 4-byte little-endian length, then its bytes), decoded here by hand for that reason."""

    __slots__ = ("_result", "_outputs")

    def __init__(self, result):
        response = result.get_response()
        raw = response.raw_output_contents
        self._result = result
        self._outputs = ({o.name: (o, raw[i]) for i, o in enumerate(response.outputs)}
                         if len(raw) == len(response.outputs) else None)  # else: not raw, as_numpy's way

    def as_numpy(self, name: str):
        if self._outputs is None:
            return self._result.as_numpy(name)
        found = self._outputs.get(name)
        if found is None:
            return None
        output, data = found
        if output.datatype != "BYTES":
            return np.frombuffer(data, dtype=_NUMPY[output.datatype]).reshape(tuple(output.shape))
        items, at = [], 0
        while at < len(data):
            size = int.from_bytes(data[at:at + 4], "little")
            items.append(data[at + 4:at + 4 + size])
            at += 4 + size
        return np.array(items, dtype=np.object_).reshape(tuple(output.shape))


_NUMPY = {"BOOL": np.bool_, "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64,
          "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64, "FP16": np.float16,
          "FP32": np.float32, "FP64": np.float64}


class Backend:
    def __init__(self, url: str):
        self.url = url
        self.client = None  # tritonclient's asyncio client, opened in the serving event loop (aio binds to it)
        self.healthy = False
        self.failed_checks = 0  # in a row
        self.in_flight = 0
        self.picked = 0
        self.models: dict[str, ModelInfo] = {}

    async def check(self) -> None:
        """Refresh health and the model list. A server that answers not ready is down; one whose check fails
        (unreachable, past HEALTH_TIMEOUT) keeps its state and models until UNHEALTHY_AFTER checks in a row have
        failed."""
        grpc = self.client
        try:
            ready = await grpc.is_server_ready(client_timeout=HEALTH_TIMEOUT)
            index = (await grpc.get_model_repository_index(client_timeout=HEALTH_TIMEOUT)).models
            models = {}
            for entry in index:
                if entry.state != "READY":
                    continue
                known = self.models.get(entry.name)
                if known is None or known.version != entry.version:
                    config = (await grpc.get_model_config(entry.name, client_timeout=HEALTH_TIMEOUT)).config
                    value = config.parameters[PARAMETER].string_value if PARAMETER in config.parameters else None
                    known = ModelInfo(entry.name, entry.version, parse_parameter(value),
                                      frozenset(i.name for i in config.input), _adapters(config),
                                      ADAPTERS in config.parameters)
                models[entry.name] = known
            for name, info in models.items():
                if info.lora and LORA_CONTROL in (info.inputs or ()):
                    models[name] = replace(info, adapters=await self._loaded(name, info.adapters))
        except Exception:
            self.failed_checks += 1
            if self.failed_checks >= UNHEALTHY_AFTER:
                self.healthy = False
            return
        self.failed_checks = 0
        self.models, self.healthy = models, bool(ready)


    async def _loaded(self, model: str, built: tuple[str, ...]) -> tuple[str, ...]:
        """The adapters `model` serves now (loaded and unloaded at run time: runtime/serving/lora_admin.py)."""
        try:
            answer = await asyncio.wait_for(control(self.client, model, {"op": "list"}), HEALTH_TIMEOUT)
        except (AdapterControlError, asyncio.TimeoutError):
            return built
        return tuple(a["name"] for a in answer["adapters"] if not a.get("draining"))


def _adapters(config) -> tuple[str, ...]:
    """The adapter names a model's config lists (none when it lists none, or not as a JSON list of names)."""
    if ADAPTERS not in config.parameters:
        return ()
    try:
        names = json.loads(config.parameters[ADAPTERS].string_value)
    except ValueError:
        return ()
    return tuple(n for n in names if isinstance(n, str)) if isinstance(names, list) else ()


class Pool:
    def __init__(self, urls: list[str], health_interval: float = HEALTH_INTERVAL):
        if not urls:
            raise ValueError("give at least one Triton gRPC url")
        self.backends = [Backend(url) for url in urls]
        self.health_interval = health_interval
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        import tritonclient.grpc.aio as aio

        for backend in self.backends:
            backend.client = aio.InferenceServerClient(backend.url)
        await self.check_all()
        self._task = asyncio.create_task(self._watch())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for backend in self.backends:
            if backend.client is not None:
                await backend.client.close()

    async def check_all(self) -> None:
        await asyncio.gather(*(b.check() for b in self.backends))

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            await self.check_all()

    @property
    def healthy(self) -> list[Backend]:
        return [b for b in self.backends if b.healthy]

    def models(self) -> dict[str, ModelInfo]:
        return {name: info for b in reversed(self.healthy) for name, info in b.models.items()}

    def adapters(self) -> dict[str, str]:
        """The LoRA adapters on the reachable servers: adapter name -> the model serving it (its parent)."""
        models = self.models()
        return {a: name for name, info in models.items() for a in info.adapters if a not in models}

    def resolve(self, model: str) -> tuple[str, str | None]:
        """(the served model, the adapter or None) a request's `model` names: a model, or an adapter of one (404
        when neither, 503 when no server is reachable)."""
        if model not in self.models():
            parent = self.adapters().get(model)
            if parent is not None:
                return parent, model
        return self._serving(model)[0].models[model].name, None

    def info(self, model: str) -> ModelInfo:
        """What a reachable server says of `model`: 503 when none is reachable, 404 when none serves it."""
        return self._serving(model)[0].models[model]

    def pick(self, model: str) -> tuple[Backend, ModelInfo]:
        """The server for a request to `model` (errors as for `info`)."""
        backend = min(self._serving(model), key=lambda b: (b.in_flight, b.picked))
        backend.picked += 1
        return backend, backend.models[model]

    def _serving(self, model: str) -> list[Backend]:
        healthy = self.healthy
        if not healthy:
            raise OpenAIError(503, f"no Triton server is reachable ({', '.join(b.url for b in self.backends)})",
                              None, "service_unavailable")
        serving = [b for b in healthy if model in b.models]
        if not serving:
            known = ", ".join(sorted([*self.models(), *self.adapters()])) or "none"
            raise OpenAIError(404, f"the model {model!r} does not exist (served: {known})", "model", "model_not_found")
        return serving

    async def generate(self, backend: Backend, model: str, prompt: str, stream: bool, gen: ChoiceGeneration,
                       params: dict) -> AsyncIterator[str]:
        """Text chunks of one request on `backend`, on its own stream as llmc.client's (leaving early
        stops the request in band: llmc/client/stream.py), with no retry on another server; the
        model's refusal raises llmc.client.Refused (400/429), a broken server marks it down and
        raises OpenAIError 503."""
        import tritonclient.grpc as grpc

        backend.in_flight += 1
        try:
            request = {"model_name": model, "inputs": make_inputs(grpc, prompt, stream, params),
                       "request_id": uuid.uuid4().hex}
            async with contextlib.aclosing(responses(backend.client, grpc, request)) as results:
                async for result, error in results:
                    chunk = gen.take(result, error)  # an error response raises Refused
                    if chunk:
                        yield chunk
        except Unreachable as err:
            backend.healthy = False  # skipped until the health check finds it ready again
            raise OpenAIError(503, f"{backend.url}: the server failed the request ({err})", None,
                              "service_unavailable") from None
        finally:
            backend.in_flight -= 1
