"""The SSE response (llmc/openai/streaming.py's EventStream) at the ASGI boundary: a client that
disconnects while a chunk is being sent still has its body generator closed, whose cleanup stops the
request's choices, without waiting for the garbage collector; and a failure no protocol anticipated is
answered, not left waiting."""

import asyncio
import gc

from starlette.responses import StreamingResponse

from llmc.openai.streaming import EventStream


def serve_until_disconnect(make_response) -> list[str]:
    """Serve a two-chunk body to a client whose socket fills after the first chunk (the second send
    never returns) and that then disconnects; what the body's generator did."""
    events: list[str] = []

    async def body():
        try:
            for chunk in (b"data: 1\n\n", b"data: 2\n\n", b"data: 3\n\n"):
                yield chunk
        finally:
            events.append("closed")

    async def main():
        first_sent, blocked = asyncio.Event(), asyncio.Event()

        async def send(message):
            if message["type"] == "http.response.body":
                if first_sent.is_set():
                    await blocked.wait()  # a full socket: this send waits for a drain that never comes
                first_sent.set()

        async def receive():
            await first_sent.wait()
            await asyncio.sleep(0.01)
            return {"type": "http.disconnect"}

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}}
        response = make_response(body())
        await asyncio.wait_for(response(scope, receive, send), 5)
        events.append("returned")

    gc.disable()  # what is asserted must not depend on a collection
    try:
        asyncio.run(main())
    finally:
        gc.enable()
    return events


def test_a_disconnect_while_a_chunk_is_sent_closes_the_body_before_the_response_returns():
    assert serve_until_disconnect(EventStream) == ["closed", "returned"]


def test_starlettes_own_streaming_response_leaves_it_open_there():
    """Why EventStream exists: this fails once Starlette closes the body itself (EventStream may go then)."""
    events = serve_until_disconnect(lambda body: StreamingResponse(body, media_type="text/event-stream"))
    assert events[:1] == ["returned"]


class _FailingPool:
    """A pool whose server fails in a way no protocol anticipated (a defect behind it)."""

    def pick(self, model):
        return object(), None

    async def generate(self, backend, model, prompt, stream, gen, params):
        yield "first "
        raise RuntimeError("the backend died")


def test_an_unexpected_failure_while_generating_answers_500_instead_of_hanging():
    from llmc.openai.protocol import OpenAIError
    from llmc.openai.streaming import Choices, Job

    async def main():
        choices = Choices(_FailingPool(), "m", [Job(0, "p", {})], stream=True, endpoint="completions")
        await choices.started()
        return [event.kind async for event in choices]

    try:
        asyncio.run(asyncio.wait_for(main(), 10))  # a TimeoutError: the request was left waiting
    except OpenAIError as err:
        assert err.status == 500 and "RuntimeError: the backend died" in err.message
    else:
        raise AssertionError("the failure was not answered")
