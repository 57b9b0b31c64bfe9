"""One request in flight on the serving loop (loop.py): its sink, and what its steps brought that is not sent yet.

    sink.send(outputs: dict[str, np.ndarray], final: bool)   # a response; the last has final=True
    sink.error(message: str)                                  # a final error response
    sink.is_cancelled() -> bool                               # the client went away

A streamed request sends what each step brought; any other collects until its end. `outputs` lays a response
out (responses.py) from what was collected and starts collecting again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from llmc.runtime.decoding.logprobs import Logprobs
from llmc.runtime.engine.core import StepOutput
from llmc.runtime.engine.sequence import FinishReason
from llmc.runtime.serving.request import Request
from llmc.runtime.serving.responses import response


class Sink(Protocol):
    def send(self, outputs: dict[str, np.ndarray], final: bool) -> None: ...
    def error(self, message: str) -> None: ...
    def is_cancelled(self) -> bool: ...


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
