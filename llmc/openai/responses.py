"""OpenAI's response bodies: whole responses and streamed chunks for /v1/completions and
/v1/chat/completions, with each endpoint's own log-probabilities format and the usage counts the
model reports (`num_input_tokens`, `num_output_tokens`)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

_FINISH = {"stop": "stop", "length": "length", "cancelled": "stop", "tool_calls": "tool_calls"}


def finish_reason(reason: str | None) -> str | None:
    return None if reason is None else _FINISH.get(reason, "stop")


@dataclass
class Reply:
    """What one request's answer shares across its chunks: id, time, model, endpoint."""

    model: str
    chat: bool
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        self.id = self.id or f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def body(self, choices: list[dict], usage: dict | None, chunk: bool = False) -> dict:
        kind = "chat.completion.chunk" if (self.chat and chunk) else self.object
        body = {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None or not chunk:
            body["usage"] = usage
        return body


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chat_logprobs(entries: list[dict]) -> dict:
    """Chat's format: content = [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]."""
    def one(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {"content": [{**one(e["token"], e["logprob"]), "top_logprobs": [one(t, v) for t, v in e["top"]]}
                        for e in entries], "refusal": None}


class CompletionLogprobs:
    """Completions' format (tokens, token_logprobs, top_logprobs, text_offset), keeping each
    choice's text offset across streamed chunks."""

    def __init__(self, offset: int = 0):
        self.offset = offset

    def format(self, entries: list[dict]) -> dict:
        offsets = []
        for e in entries:
            offsets.append(self.offset)
            self.offset += len(e["token"])
        return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [_best_first(e["top"]) for e in entries], "text_offset": offsets}


def _best_first(top: list[tuple[str, float]]) -> dict[str, float]:
    """{token: logprob}; tokens that decode alike (pieces of one character) keep the best value."""
    out: dict[str, float] = {}
    for token, value in top:
        out.setdefault(token, value)
    return out


def chat_choice(index: int, text: str | None, reason: str | None, logprobs: dict | None,
                tool_calls: list[dict] | None = None) -> dict:
    """A whole chat choice; with `tool_calls` (parsed from a complete output) the message carries them,
    beside the text outside them (None when there is none), and finish_reason is tool_calls."""
    if tool_calls:
        return {"index": index, "message": {"role": "assistant", "content": text, "tool_calls": tool_calls},
                "logprobs": logprobs, "finish_reason": "tool_calls"}
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
            "finish_reason": finish_reason(reason)}


def chat_delta(index: int, delta: dict, reason: str | None = None, logprobs: dict | None = None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason(reason)}


def completion_choice(index: int, text: str, reason: str | None, logprobs: dict | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason(reason)}
