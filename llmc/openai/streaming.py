"""A request's choices run as worker tasks, merged into one stream of events, and that stream as
Server-Sent Events in OpenAI's chunk format (ending with `data: [DONE]`).

The workers run outside the HTTP request's task on purpose: when a client disconnects, Starlette
cancels the response's task group, and anyio's cancellation is level-triggered, so the client's
in-band stop (llmc/client/stream.py: a stop request, then the stream closes with nothing pending) could not
be awaited there. Cancelling a worker instead raises one CancelledError inside its generate(),
whose cleanup then stops the request on the server, which frees its KV slot.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import AsyncIterator

import orjson
from starlette.responses import StreamingResponse

from llmc.client import Refused
from llmc.openai.backends import ChoiceGeneration, Pool
from llmc.openai.protocol import OpenAIError, model_error
from llmc.openai.responses import CompletionLogprobs, Reply, chat_delta, chat_logprobs, completion_choice, usage
from llmc.openai.structured import Guided, stream_for

_log = logging.getLogger(__name__)
_RUNNING: set[asyncio.Task] = set()  # workers are referenced until they end


@dataclass
class Job:
    """One choice: its index, prompt and model inputs, and its generation's state."""

    index: int
    prompt: str
    params: dict
    gen: ChoiceGeneration = field(default_factory=ChoiceGeneration)
    offsets: CompletionLogprobs = field(default_factory=CompletionLogprobs)
    logprobs: list[dict] = field(default_factory=list)  # gathered for a whole (not streamed) answer


@dataclass(slots=True)
class Event:
    kind: str  # "text" | "end" | "error"
    job: Job
    text: str = ""
    logprobs: list = field(default_factory=list)  # of this event's tokens, taken when it happened
    error: Exception | None = None


class Choices:
    """Start every job on a server the pool picks; iterate the merged events; `cancel` stops what runs."""

    def __init__(self, pool: Pool, model: str, jobs: list[Job], stream: bool, endpoint: str,
                 guide_param: str | None = None):
        self.endpoint, self.jobs, self.guide_param = endpoint, jobs, guide_param
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        picked = [pool.pick(model)[0] for _ in jobs]  # raises before anything starts
        self._tasks = [asyncio.create_task(self._work(pool, backend, model, job, stream))
                       for backend, job in zip(picked, jobs)]
        for task in self._tasks:
            _RUNNING.add(task)
            task.add_done_callback(_RUNNING.discard)
        self._open = len(jobs)
        self._first: list[Event] = []

    async def started(self) -> None:
        """Wait for the first event, so that a refusal (or an unreachable server) is answered with
        its HTTP status before a stream begins."""
        event = await self._queue.get()
        if event.kind == "error":
            self.cancel()
            raise self.error(event)
        self._first.append(event)

    async def _work(self, pool: Pool, backend, model: str, job: Job, stream: bool) -> None:
        try:
            async for chunk in pool.generate(backend, model, job.prompt, stream, job.gen, job.params):
                self._queue.put_nowait(Event("text", job, chunk, job.gen.take_logprobs()))
            self._queue.put_nowait(Event("end", job, "", job.gen.take_logprobs()))
        except (Refused, OpenAIError) as err:
            self._queue.put_nowait(Event("error", job, error=err))
        except Exception as err:  # a defect behind the pool: answered 500 (and logged), never left waiting
            _log.exception("generating choice %d on %s failed", job.index, model)
            self._queue.put_nowait(Event("error", job, error=OpenAIError(
                500, f"the server failed generating this request: {type(err).__name__}: {err}", None, "server_error")))

    def error(self, event: Event) -> OpenAIError:
        if isinstance(event.error, OpenAIError):
            return event.error
        return model_error(str(event.error), self.endpoint, self.guide_param)

    async def __aiter__(self) -> AsyncIterator[Event]:
        while self._open:
            event = self._first.pop() if self._first else await self._queue.get()
            self._open -= event.kind != "text"
            if event.kind == "error":
                self.cancel()
                raise self.error(event)
            yield event

    def cancel(self) -> None:
        for task in self._tasks:
            task.cancel()


class EventStream(StreamingResponse):
    """An SSE response whose body generator is closed when the response ends, however it ends. Starlette
    cancels a stream whose client disconnected but closes its generator only when the cancellation lands
    inside it; one landing while a chunk is being sent (a slow client's full socket) would leave the
    generator, and the `choices.cancel()` in its `finally`, to the garbage collector, its requests
    generating meanwhile."""

    def __init__(self, body: AsyncIterator[bytes]):
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # the generator itself: Starlette keeps an async iterable as given


def sse(data: dict) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


class Chunks:
    """A request's streamed chunks as SSE events. Every chunk shares its envelope (id, object,
    created, model; "usage": null on every chunk but the last when usage is asked), so the envelope
    is serialized once per request and only the choice once per chunk (orjson): the JSON of
    `reply.body([choice], None, chunk=True)`, written without building and encoding it whole."""

    def __init__(self, reply: Reply, include_usage: bool):
        envelope = orjson.dumps(reply.body([], None, chunk=True))
        assert envelope.endswith(b'"choices":[]}')
        self._head = b"data: " + envelope[:-2]
        self._tail = b"]" + (b',"usage":null' if include_usage else b"") + b"}\n\n"

    def __call__(self, choice: dict) -> bytes:
        return self._head + orjson.dumps(choice) + self._tail


async def stream_events(choices: Choices, reply: Reply, include_usage: bool, echo: bool = False,
                        logprobs: bool = False, calls: Guided | None = None) -> AsyncIterator[bytes]:
    """The SSE body; a failure after the first chunk ends the stream with an error event. `calls`: a
    tool choice's guide, whose output streams as delta.tool_calls (structured.stream_for)."""
    chunk = Chunks(reply, include_usage)
    tools = {job.index: stream_for(calls) for job in choices.jobs} if calls is not None else None
    try:
        for job in choices.jobs:  # each choice opens with its role (chat) or the echoed prompt
            if reply.chat:
                yield chunk(chat_delta(job.index, {"role": "assistant", "content": ""}))
            elif echo:
                job.offsets.offset = len(job.prompt)
                yield chunk(completion_choice(job.index, job.prompt, None, None))
        async for event in choices:
            if tools is not None:
                for choice in _tool_chunks(tools[event.job.index], event, logprobs):
                    yield chunk(choice)
                continue
            yield chunk(_choice_chunk(reply, event, logprobs))
        if include_usage:
            yield sse(reply.body([], usage_of(choices.jobs), chunk=True))
    except OpenAIError as err:
        yield sse(err.body())
    finally:
        choices.cancel()  # the client went away (or it all ended): stop what still runs
    yield b"data: [DONE]\n\n"


def _choice_chunk(reply: Reply, event: Event, logprobs: bool) -> dict:
    job, end = event.job, event.kind == "end"
    reason = job.gen.finish_reason if end else None
    entries = event.logprobs
    if reply.chat:
        delta = {} if end else {"content": event.text}
        return chat_delta(job.index, delta, reason, chat_logprobs(entries) if logprobs else None)
    return completion_choice(job.index, event.text, reason, job.offsets.format(entries) if logprobs else None)


def _tool_chunks(stream, event: Event, logprobs: bool) -> list[dict]:
    """A tool choice's event as chat chunks: its deltas, and at the end its finish reason."""
    job, lp = event.job, chat_logprobs(event.logprobs) if logprobs else None
    if event.kind != "end":
        delta = stream.delta(event.text)
        return [chat_delta(job.index, delta, None, lp)] if delta is not None else []
    reason = job.gen.finish_reason
    deltas, called = stream.end(reason)
    done = "tool_calls" if called else reason
    return [chat_delta(job.index, d) for d in deltas] + [chat_delta(job.index, {}, done, lp)]


def usage_of(jobs: list[Job]) -> dict:
    prompts = {job.prompt: job.gen.num_input_tokens or 0 for job in jobs}  # n choices of a prompt: counted once
    return usage(sum(prompts.values()), sum(job.gen.num_output_tokens or 0 for job in jobs))
