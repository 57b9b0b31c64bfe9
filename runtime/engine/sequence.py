"""A request's state while it is generated: prompt, sampled ids, KV slot, streaming text, finish."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from llmc.runtime.decoding.tokenizer import IncrementalDetokenizer, StopMatcher
from llmc.runtime.decoding.grammar import GuideMatcher
from llmc.runtime.decoding.logprobs import LogprobRecorder
from llmc.runtime.decoding.sampling import SamplingParams
from llmc.runtime.lora.stacks import AdapterRef, AdapterWeights

if TYPE_CHECKING:
    from llmc.runtime.engine.beam import BeamSearch


class FinishReason(str, enum.Enum):
    stop = "stop"  # an end id or a stop word
    length = "length"  # max_tokens, or the KV capacity
    cancelled = "cancelled"


class Status(str, enum.Enum):
    waiting = "waiting"  # queued, no slot yet
    prefilling = "prefilling"  # has a slot; prompt (partly) not yet in the cache
    decoding = "decoding"
    finished = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None = None
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.waiting
    slot: int | None = None  # its KV slot (slot graphs)
    block_ids: list[int] = field(default_factory=list)  # its KV blocks, in token order (paged graphs)
    num_cached: int = 0  # tokens already written to this sequence's KV slot or blocks
    draft_cached: int = 0  # speculative.method draft: tokens whose draft-model KV is in the blocks (speculation/draft.py)
    long_rope: bool = False  # its KV were computed with LongRoPE's long factors (engine/longrope.py)
    finish_reason: FinishReason | None = None
    logprobs: LogprobRecorder | None = None  # set when the request asked for log probabilities
    beam: "BeamSearch | None" = None  # beam_width > 1: its beams are rows of their own (runtime/engine/beam.py)
    guide: GuideMatcher | None = None  # structured output: its grammar's state (decoding/grammar.py)
    adapter: AdapterRef | None = None  # its LoRA adapter (None: the base model)
    lora: AdapterWeights | None = None  # that adapter's weights, held while it runs (engine/lora_slots.py)
    lora_passes: int = 0  # schedules that passed it over while its adapter waited for a slot (engine/lora_slots.py)
    text: str = ""  # everything emitted so far
    _pending: str = ""  # emitted by the last step, not yet taken by the caller

    def __post_init__(self) -> None:
        self.rng = self.params.make_rng()
        self.stops = StopMatcher(self.params.stop_words)
        self._prompt = np.asarray(self.prompt_ids, dtype=np.int64)
        self.adapter_key = self.adapter.key if self.adapter is not None else None  # its blocks' key chain

    @property
    def is_finished(self) -> bool:
        return self.status is Status.finished

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def all_token_ids(self) -> list[int]:
        """Prompt and output so far: what the KV cache holds once this sequence is fully computed."""
        return self.prompt_ids + self.output_ids

    @property
    def last_token_id(self) -> int:
        """The newest token: what a decoding step feeds."""
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    def prompt_array(self) -> np.ndarray:
        return self._prompt

    def append(self, token: int) -> None:
        """Record a sampled token: stream its text, and finish on an end id, a stop word, a grammar
        that can take nothing more, or max_tokens."""
        self.output_ids.append(token)
        if token in self.params.end_ids and (len(self.output_ids) > self.params.min_tokens or self.guide is not None):
            self.finish(FinishReason.stop)  # a guided row's end id is allowed only where its grammar ends
            return
        if self.guide is not None:
            self.guide.consume(token)
        if self.detokenizer is not None:
            self._emit(self.stops.feed(self.detokenizer.push(token)))
            if self.stops.stopped:
                self.finish(FinishReason.stop)
                return
        if self.guide is not None and self.guide.is_stopped:
            self.finish(FinishReason.stop)
            return
        if len(self.output_ids) >= self.params.max_tokens:
            self.finish(FinishReason.length)

    def _emit(self, text: str) -> None:
        self.text += text
        self._pending += text

    def finish(self, reason: FinishReason) -> None:
        """End the sequence; text still held back (a partial character or stop-word prefix) is
        released unless a stop word ended it."""
        if self.is_finished:
            return
        if self.detokenizer is not None and not self.stops.stopped:
            self._emit(self.stops.feed(self.detokenizer.finish()))
            self._emit(self.stops.finish())
            if self.stops.stopped and reason is FinishReason.length:
                reason = FinishReason.stop
        self.status, self.finish_reason = Status.finished, reason

    def take_text(self) -> str:
        """Text emitted since the last call (what a streaming response sends)."""
        text, self._pending = self._pending, ""
        return text
