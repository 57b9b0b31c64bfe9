"""A request in flight and the responses it sends: its sink, what its steps brought that is not sent yet, and the
response tensors laid out from it (the text, ids, beams and log probabilities are made in the engine; nothing here
decodes). The serving loop (loop.py) holds one `LiveRequest` per request.

    sink.send(outputs: dict[str, np.ndarray], final: bool)   # a response; the last has final=True
    sink.error(message: str)                                  # a final error response
    sink.is_cancelled() -> bool                               # the client went away
    sink.finish()                                             # the final flag alone, once a request is cancelled

A streamed request sends what each step brought; any other collects until its end. Names and shapes are
TensorRT-LLM's (tensors.py):

    text_output [1], output_ids [len]                       every response
    finish_reason [1], num_input_tokens [1], num_output_tokens [1]   the final one (the counts when asked)
    output_log_probs [len], cum_log_probs [1], token_texts [len],
    top_log_prob_ids / top_log_probs / top_token_texts [len, N]      with return_log_probs
    text_output [W], output_ids [W, longest], sequence_length [W], cum_log_probs [W]
                                                            a beam request's one response, best beam first
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from llmc.runtime.decoding.logprobs import Logprobs
from llmc.runtime.engine.core import StepOutput
from llmc.runtime.engine.sequence import FinishReason
from llmc.runtime.serving.request import Request


def bytes_tensor(value: str) -> np.ndarray:
    return np.array([value.encode("utf-8")], dtype=np.object_)


def int32_tensor(value: int) -> np.ndarray:
    return np.array([value], dtype=np.int32)


def response(request: Request, ids: list[int], text: str, *, reason: FinishReason | None, beams: tuple = (),
             pad_id: int = 0, logprobs: Logprobs | None = None, num_prompt_tokens: int = 0,
             num_output_tokens: int = 0) -> dict[str, np.ndarray]:
    """One response: the `ids` and `text` it carries (a beam request: its `beams`, padded with
    `pad_id`), their `logprobs`, and when `reason` is given what a final response adds. The prompt
    leads the text of a non-streamed request unless it asked to exclude it."""
    prefix = request.prompt if not request.stream and not request.exclude_input_in_output else ""
    if beams:
        outputs = beam_outputs(beams, prefix, pad_id)
    else:
        outputs = {"text_output": bytes_tensor(prefix + text), "output_ids": np.array(ids, dtype=np.int32)}
    if logprobs is not None:  # the values of exactly the tokens in output_ids
        outputs.update(logprob_outputs(logprobs))
    if reason is not None:
        outputs["finish_reason"] = bytes_tensor(reason.value)
        if request.return_num_input_tokens:
            outputs["num_input_tokens"] = int32_tensor(num_prompt_tokens)
        if request.return_num_output_tokens:
            outputs["num_output_tokens"] = int32_tensor(num_output_tokens)
    return outputs


def beam_outputs(beams, prefix: str, pad_id: int) -> dict[str, np.ndarray]:
    """A finished beam request's response tensors (beam.py's Beam, best first): text_output [W]
    (each after `prefix`), output_ids [W, longest] (padded with `pad_id`), sequence_length [W],
    cum_log_probs [W]."""
    ids = np.full((len(beams), max(len(b.token_ids) for b in beams)), pad_id, np.int32)
    for row, b in zip(ids, beams):
        row[:len(b.token_ids)] = b.token_ids
    return {"text_output": np.array([(prefix + b.text).encode("utf-8") for b in beams], dtype=np.object_),
            "output_ids": ids, "sequence_length": np.array([len(b.token_ids) for b in beams], np.int32),
            "cum_log_probs": np.array([b.cum_log_prob for b in beams], np.float32)}


def logprob_outputs(logprobs: Logprobs) -> dict[str, np.ndarray]:
    """The log-probability tensors of a response's tokens (logprobs.py): per token, the sum so far,
    and with num_top the alternatives of each step."""
    outputs = {"output_log_probs": np.asarray(logprobs.values, dtype=np.float32),
               "cum_log_probs": np.array([logprobs.cumulative], dtype=np.float32),
               "token_texts": _texts(logprobs.token_texts)}
    if logprobs.num_top:
        outputs["top_log_prob_ids"] = logprobs.top_ids
        outputs["top_log_probs"] = logprobs.top_values
        outputs["top_token_texts"] = _texts([t for row in logprobs.top_texts for t in row]).reshape(
            logprobs.top_ids.shape)
    return outputs


def _texts(texts) -> np.ndarray:
    return np.array([t.encode("utf-8") for t in texts], dtype=np.object_)


class Sink(Protocol):
    def send(self, outputs: dict[str, np.ndarray], final: bool) -> None: ...
    def error(self, message: str) -> None: ...
    def is_cancelled(self) -> bool: ...
    def finish(self) -> None: ...


@dataclass
class LiveRequest:
    request: Request
    sink: Sink
    num_prompt_tokens: int
    arrived: float
    last_token_at: float | None = None
    ids: list[int] = field(default_factory=list)  # not yet sent (streaming) / all (otherwise)
    text: list[str] = field(default_factory=list)
    num_output_tokens: int = 0
    client_id: str = ""  # the request id the client sent it under (what a stop request names)
    closed: bool = False  # the sink reported a cancellation (or failed): nothing more is sent on it
    # the request asked for log probabilities: the records of `ids`, a step's at a time, after an empty one
    # carrying the sum so far (joined once, when a response is sent)
    logprobs: list[Logprobs] | None = None
    stopped: bool = False  # a stop request named it while its guide compiled (it never reached the engine)

    def collect(self, out: StepOutput) -> None:
        """What one step brought it: tokens, their text, their log probabilities."""
        self.ids += out.token_ids
        self.text.append(out.text)
        if self.logprobs is not None and out.logprobs is not None:
            self.logprobs.append(out.logprobs)
        self.num_output_tokens += len(out.token_ids)

    def outputs(self, reason: FinishReason | None, beams: tuple, end_ids: tuple[int, ...]) -> dict[str, np.ndarray]:
        """The response tensors of what was collected (the final one's when `reason` is given); collecting
        starts again after them."""
        logprobs = Logprobs.concat(self.logprobs) if self.logprobs is not None else None
        outputs = response(self.request, self.ids, "".join(self.text), reason=reason, beams=beams,
                           pad_id=end_ids[0] if end_ids else 0, logprobs=logprobs,
                           num_prompt_tokens=self.num_prompt_tokens, num_output_tokens=self.num_output_tokens)
        self.ids, self.text = [], []
        if logprobs is not None:  # the next response carries the tokens after these
            self.logprobs = [Logprobs.empty(logprobs.num_top, logprobs.cumulative)]
        return outputs


def call(fn, *args) -> tuple[bool, object]:
    """Call into a sink: (whether it worked, its result). A sink that raises (its client is gone)
    must not stop the loop."""
    try:
        return True, fn(*args)
    except Exception:
        return False, None
