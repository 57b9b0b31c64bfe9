"""The OpenAI-compatible API as a FastAPI app over the Triton servers in a `Pool`.

    GET  /health                 200 when a server is reachable, else 503
    GET  /v1/models              the models READY on the reachable servers, and the LoRA adapters each serves
                                 (an adapter's `parent` is its model; a request names an adapter as its `model`)
    POST /v1/completions         prompt (string or list) -> text; streamed as SSE with stream: true
    POST /v1/chat/completions    messages -> the model's chat template -> text; 400 without a template
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter   with allow_lora_updates only (adapters.py)

Every error is OpenAI's body ({"error": {"message", "type", "param", "code"}}). With `api_key`, every
/v1 route needs `Authorization: Bearer KEY` (401 otherwise); request bodies are capped at
`max_body_size` bytes (413).
"""

from __future__ import annotations

import asyncio
import hmac
import json
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from llmc.chat_template import ChatTemplateError, NoChatTemplate, render
from llmc.openai.adapters import add_routes, allowed
from llmc.openai.backends import ModelInfo, Pool
from llmc.openai.protocol import (MAX_CHOICES, ChatRequest, CompletionRequest, OpenAIError, model_inputs,
                                  num_top_logprobs, refuse_unsupported)
from llmc.openai.responses import (CompletionLogprobs, Reply, chat_choice, chat_logprobs, completion_choice)
from llmc.openai.streaming import Choices, EventStream, Job, stream_events, usage_of
from llmc.openai.structured import Guided, guide_of, tool_calls
from llmc.openai.tool_parsers import default_messages
from llmc.runtime.serving.tensors import LORA_NAME

MAX_BODY_SIZE = 4 * 1024 * 1024  # bytes
DISCONNECT_POLL = 0.5  # seconds between checks for a client gone before its stream started


def create_app(urls: list[str], *, api_key: str | None = None, max_body_size: int = MAX_BODY_SIZE,
               health_interval: float = 2.0, allow_lora_updates: bool = False, repository: str | None = None
               ) -> FastAPI:
    """`allow_lora_updates` (or LLMC_ALLOW_RUNTIME_LORA_UPDATING=1) with the servers' `repository`: the
    /v1/load_lora_adapter and /v1/unload_lora_adapter routes (llmc/openai/adapters.py)."""
    pool = Pool(urls, health_interval)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await pool.start()
        yield
        await pool.close()

    app = FastAPI(title="llmc OpenAI-compatible API", lifespan=lifespan)
    app.state.pool = pool
    _add_error_handlers(app)
    app.add_middleware(_BodyLimit, max_body_size=max_body_size)

    @app.get("/health")
    async def health():
        if not pool.healthy:
            raise OpenAIError(503, "no Triton server is reachable", None, "service_unavailable")
        return {"status": "ok", "servers": {b.url: b.healthy for b in pool.backends}}

    router = APIRouter(prefix="/v1", dependencies=[Depends(_bearer(api_key))])

    @router.get("/models")
    async def models():
        adapters = pool.adapters()
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "llmc",
                                            **({"parent": adapters[name]} if name in adapters else {})}
                                           for name in sorted([*pool.models(), *adapters])]}

    @router.post("/completions")
    async def completions(req: CompletionRequest, request: Request):
        refuse_unsupported(req)
        guided = guide_of(req)
        prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        if not prompts:
            raise OpenAIError(400, "prompt: give at least one prompt", "prompt")
        if len(prompts) * req.n > MAX_CHOICES:
            raise OpenAIError(400, f"prompt: {len(prompts)} prompts x n {req.n} is above {MAX_CHOICES} choices a request",
                              "prompt")
        model, adapter = pool.resolve(req.model)
        jobs = [Job(i * req.n + j, p, _inputs(req, j, guided, adapter=adapter)) for i, p in enumerate(prompts)
                for j in range(req.n)]
        return await _answer(pool, model, req, request, Reply(req.model, chat=False), jobs, "completions", guided)

    @router.post("/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request):
        refuse_unsupported(req)
        model, adapter = pool.resolve(req.model)
        info = pool.info(model)
        if info.chat_template is None:
            raise OpenAIError(400, str(NoChatTemplate(req.model)), "messages", "model_has_no_chat_template")
        guided = guide_of(req, info.chat_template["template"], info.chat_template.get("tool_call_format"))
        messages = _messages(req.messages)
        if guided is not None and guided.auto == "json":  # a template with no tool format: llmc's, described
            messages = default_messages(messages, req.tools)
        try:
            prompt = render(info.chat_template, messages, tools=req.tools)
        except ChatTemplateError as err:
            raise OpenAIError(400, str(err), "messages") from None
        jobs = [Job(j, prompt, _inputs(req, j, guided, info, adapter)) for j in range(req.n)]
        return await _answer(pool, model, req, request, Reply(req.model, chat=True), jobs, "chat", guided)

    if allowed(allow_lora_updates):
        if repository is None:
            raise ValueError("runtime LoRA updates need the servers' model repository (--repository): the adapters "
                             "go into its store, where every replica reads them")
        add_routes(router, pool, repository)
    app.include_router(router)
    return app


async def _started(choices: Choices, request: Request) -> None:
    """Wait for the first event (a queued request waits for a slot), giving up with the client: a
    client that leaves before its stream starts leaves the server's queue too."""
    first = asyncio.ensure_future(choices.started())
    try:
        while not (await asyncio.wait({first}, timeout=DISCONNECT_POLL))[0]:
            if await request.is_disconnected():
                choices.cancel()
                raise OpenAIError(400, "the client disconnected before the stream started")
        first.result()
    finally:
        first.cancel()


def _inputs(req, choice: int, guided: Guided | None, info: ModelInfo | None = None, adapter: str | None = None) -> dict:
    inputs = {**model_inputs(req, choice), **(guided.inputs() if guided is not None else {})}
    if adapter is not None:
        inputs[LORA_NAME] = adapter
    if info is not None and info.inputs is not None and "add_special_tokens" not in info.inputs:
        inputs.pop("add_special_tokens", None)  # a model built before that input: it adds them, as it always did
    return inputs


async def _answer(pool: Pool, model: str, req, request: Request, reply: Reply, jobs: list[Job], endpoint: str,
                  guided: Guided | None):
    """`model`: the served model the jobs go to (req.model's, or the model serving the adapter req.model names)."""
    logprobs = num_top_logprobs(req) is not None
    choices = Choices(pool, model, jobs, req.stream, endpoint, guided.param if guided else None)
    echo = getattr(req, "echo", False)
    calls = guided if guided is not None and guided.parses_calls else None
    if req.stream:
        await _started(choices, request)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return EventStream(stream_events(choices, reply, include_usage, echo, logprobs, calls))
    texts = {job.index: "" for job in jobs}
    async for event in choices:
        texts[event.job.index] += event.text
        event.job.logprobs += event.logprobs
    return reply.body([_whole_choice(reply, job, texts[job.index], echo, logprobs, calls) for job in jobs],
                      usage_of(jobs))


def _whole_choice(reply: Reply, job: Job, text: str, echo: bool, logprobs: bool, calls: Guided | None) -> dict:
    entries = job.logprobs if logprobs else []
    if reply.chat:
        content, found = tool_calls(calls, text) if calls is not None and job.gen.finish_reason == "stop" else (text, [])
        return chat_choice(job.index, content, job.gen.finish_reason, chat_logprobs(entries) if logprobs else None,
                           found)  # a call cut by max_tokens stays text
    offsets = CompletionLogprobs(len(job.prompt) if echo else 0)
    return completion_choice(job.index, job.prompt + text if echo else text, job.gen.finish_reason,
                             offsets.format(entries) if logprobs else None)


def _messages(messages: list[dict]) -> list[dict]:
    """OpenAI messages as chat templates expect them: text parts joined into one string, tool-call
    arguments (a JSON string in the API) as objects (what transformers' templates iterate)."""
    out = []
    for i, message in enumerate(messages):
        message = dict(message)
        if "role" not in message:
            raise OpenAIError(400, f"messages[{i}]: every message needs a role", f"messages[{i}].role")
        content = message.get("content")
        if isinstance(content, list):
            if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                raise OpenAIError(400, f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
            message["content"] = "".join(p.get("text", "") for p in content)
        calls = []
        for call in message.get("tool_calls") or []:
            function = dict(call.get("function", {}))
            try:
                function["arguments"] = json.loads(function.get("arguments") or "{}")
            except (TypeError, json.JSONDecodeError):
                pass  # already an object, or not JSON: passed as given
            calls.append({**call, "function": function})
        if calls:
            message["tool_calls"] = calls
        out.append(message)
    return out


def _bearer(api_key: str | None):
    async def check(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), api_key.encode()):
            raise OpenAIError(401, "a valid API key is required: send Authorization: Bearer KEY", None,
                              "invalid_api_key")
    return check


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(request, err: OpenAIError):
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, err: RequestValidationError):
        first = err.errors()[0]
        loc = [str(p) for p in first["loc"] if p != "body"]
        where, param = ".".join(loc) or "body", loc[0] if loc else None
        return JSONResponse(OpenAIError(400, f"{where}: {first['msg']}", param, "invalid_parameter").body(),
                            status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request, err: HTTPException):
        return JSONResponse(OpenAIError(err.status_code, str(err.detail)).body(), status_code=err.status_code)


class _BodyLimit:
    """Request bodies capped at `max_body_size` bytes, answered with OpenAI's 413 body: a declared
    length at once, an undeclared one as it arrives. Written here because Starlette's own limit
    answers in plain text, outside the app's error handlers."""

    def __init__(self, app, max_body_size: int):
        self.app, self.max_body_size = app, max_body_size

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        err = OpenAIError(413, f"the request body is larger than {self.max_body_size} bytes", None, "body_too_large")
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body_size:
            return await JSONResponse(err.body(), status_code=413)(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_body_size:
                raise err
            return message

        await self.app(scope, limited, send)
