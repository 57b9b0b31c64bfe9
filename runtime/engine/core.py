"""What both engines hold: the requests, from `add_request` to their last `StepOutput`.

An engine is a scheduler and a runner around one `EngineCore`: slot_engine.py (a KV slot per
request) and paged_engine.py (KV in blocks) each plan and run their steps their own way and leave
the requests to the core. The core keeps them by id, queues them with the engine's scheduler, takes
cancellations from other threads, turns logits rows into tokens (sampling, log probabilities,
text through each sequence's detokenizer) and makes a step's outputs, giving the KV of finished
requests back. Token ids become text here, in the engine, for every output: the streamed text, a
beam's text and the log probabilities' token texts; the serving wing only lays them out.

`add_request`, `cancel` and `abort_all` may be called from other threads; a step belongs to one
loop thread and holds `lock` while it touches the queues.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from llmc.runtime.decoding.tokenizer import IncrementalDetokenizer
from llmc.runtime.decoding.grammar import GuideMatcher
from llmc.runtime.decoding.logprobs import LogprobRecorder, Logprobs
from llmc.runtime.decoding.sampling import SamplingParams, sample_guided
from llmc.runtime.engine.sequence import FinishReason, Sequence
from llmc.runtime.lora.stacks import AdapterRef


class QueueFull(Exception):
    """The waiting queue is at `max_queue_size`: the caller should answer "busy, retry"."""


class WaitingQueue:
    """What every scheduler has: a bounded queue of sequences waiting for a place in the running batch."""

    def __init__(self, max_queue_size: int):
        self.max_queue_size = max_queue_size
        self.waiting: deque[Sequence] = deque()

    def add(self, seq: Sequence) -> None:
        if len(self.waiting) >= self.max_queue_size:
            raise QueueFull(f"the waiting queue is full ({self.max_queue_size} requests); retry later")
        self.waiting.append(seq)

    def drop_waiting(self, seq: Sequence) -> None:
        if seq in self.waiting:
            self.waiting.remove(seq)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)


class Scheduling(Protocol):
    """What the core needs of an engine's scheduler: queue a sequence, drop it, give its KV back."""

    def add(self, seq: Sequence) -> None: ...
    def drop_waiting(self, seq: Sequence) -> None: ...
    def release(self, seq: Sequence) -> None: ...


@dataclass(frozen=True)
class StepOutput:
    request_id: str
    token_ids: list[int]  # sampled this step (empty for a cancelled request)
    text: str  # text made final this step
    finish_reason: FinishReason | None
    beams: tuple | None = None  # a finished beam request's beams, best first (beam.py's Beam)
    logprobs: Logprobs | None = None  # the log probabilities of token_ids, when the request asked

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class CacheState:
    """The KV cache and the queues, as the metrics show them: sequences running and waiting, the
    fraction of the cache in use; for the paged cache, its blocks and the totals since start."""

    running: int
    waiting: int
    usage: float
    blocks: dict[str, int] | None = None  # used / free / cached blocks (paged cache)
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # prompt tokens found there
    preemptions: int = 0
    draft_tokens: int = 0  # speculative decoding: proposed tokens verified, since start
    accepted_draft_tokens: int = 0  # of them, accepted by the target


class Engine(Protocol):
    """What the serving loop drives: SlotEngine and PagedEngine."""

    @property
    def end_ids(self) -> tuple[int, ...]: ...

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    logprobs: int | None = None, guide: GuideMatcher | None = None,
                    adapter: str | None = None) -> Sequence: ...
    def cancel(self, request_id: str) -> None: ...
    def abort_all(self) -> None: ...
    def step(self) -> list[StepOutput]: ...
    def cache_state(self) -> CacheState: ...
    def idle(self) -> None: ...  # the loop has no work: what can be done ahead of the next request
    @property
    def has_work(self) -> bool: ...
    def close(self) -> None: ...


class EngineCore:
    def __init__(self, scheduler: Scheduling, tokenizer=None, *, end_ids: tuple[int, ...] = (), capacity: int,
                 max_beam_width: int = 1):
        self.scheduler, self.tokenizer, self.end_ids = scheduler, tokenizer, tuple(end_ids)
        self.capacity, self.max_beam_width = capacity, max_beam_width
        self.lock = threading.Lock()
        self._active: dict[str, Sequence] = {}
        self._cancelled: list[Sequence] = []

    def sequence(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 logprobs: int | None = None, guide: GuideMatcher | None = None,
                 adapter: AdapterRef | None = None) -> Sequence:
        """A new request's sequence, not queued yet; ValueError for one that cannot run. `logprobs`:
        record the log probabilities of its tokens, with that many alternatives each (logprobs.py);
        `guide`: its compiled grammar's matcher (grammar.py), which every token it samples obeys;
        `adapter`: the LoRA adapter it runs under (the engine resolved its name)."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) >= self.capacity:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens; at most {self.capacity - 1} fit max_seq_len "
                             f"({self.capacity}) with room to generate")
        if params.beam_width > self.max_beam_width:
            raise ValueError(f"beam_width: {params.beam_width} is above this model's limit of {self.max_beam_width} "
                             f"(serving.max_beam_width)")
        if guide is not None and params.beam_width > 1:
            raise ValueError(f"guided_decoding_guide: not with beam search (beam_width {params.beam_width}); "
                             "a guided request takes beam_width 1")
        if not params.end_ids and self.end_ids:
            params = params.model_copy(update={"end_ids": self.end_ids})
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids) if self.tokenizer is not None else None
        recorder = LogprobRecorder(logprobs) if logprobs is not None else None
        return Sequence(request_id, list(prompt_ids), params, detokenizer=detok, logprobs=recorder, guide=guide,
                        adapter=adapter)

    def queue(self, seq: Sequence) -> Sequence:
        """Hand `seq` to the scheduler; ValueError for an id already running, QueueFull when busy."""
        with self.lock:
            if seq.request_id in self._active:
                raise ValueError(f"request id {seq.request_id!r} is already running")
            self.scheduler.add(seq)
            self._active[seq.request_id] = seq
        return seq

    def adapter_users(self, name: str) -> tuple[int, int]:
        """(running, queued) requests under the LoRA adapter `name` (any digest): what an unload waits for. A running
        one holds its adapter's weights (lora_slots.py)."""
        with self.lock:
            seqs = [s for s in self._active.values() if s.adapter is not None and s.adapter.name == name]
        running = sum(1 for s in seqs if s.lora is not None)
        return running, len(seqs) - running

    def cancel(self, request_id: str) -> None:
        """Stop a request at the next step; its KV is freed then."""
        with self.lock:
            seq = self._active.get(request_id)
            if seq is not None:
                self._cancelled.append(seq)

    def abort_all(self) -> None:
        """Drop every request (after a failed step, whose state cannot be trusted); KV is freed."""
        with self.lock:
            for seq in self._active.values():
                seq.finish(FinishReason.cancelled)
                self.scheduler.drop_waiting(seq)
                self.scheduler.release(seq)
            self._active.clear()
            self._cancelled.clear()

    @property
    def has_work(self) -> bool:
        return bool(self._active)

    def take_cancelled(self) -> list[Sequence]:
        """End the requests cancelled since the last step (call under `lock`, before admitting: a
        waiting request takes the KV they give back this step); those that were still running."""
        cancelled, self._cancelled = self._cancelled, []
        for seq in cancelled:
            seq.finish(FinishReason.cancelled)
            self.scheduler.drop_waiting(seq)
            self.scheduler.release(seq)
        return [s for s in cancelled if s.finish_reason is FinishReason.cancelled]

    def sample(self, seqs: list[Sequence], logits: np.ndarray, sampled: dict[str, list[int]]) -> None:
        """The next token of each sequence from its row of `logits` [len(seqs), V], in one pass, guided rows
        under their grammars (decoding/sampling.py's sample_guided: which guided rows draw first, which are masked first)."""
        tokens = sample_guided(logits, [s.params for s in seqs], [s.prompt_array() for s in seqs],
                               [s.output_ids for s in seqs], [s.rng for s in seqs], [s.guide for s in seqs],
                               self.end_ids)
        for seq, row, token in zip(seqs, logits, tokens.tolist()):
            self.emit(seq, row, token, sampled)

    @staticmethod
    def emit(seq: Sequence, logits: np.ndarray, token: int, sampled: dict[str, list[int]]) -> None:
        """`token`, drawn from the row `logits`, becomes `seq`'s next token."""
        if seq.logprobs is not None:  # from the raw logits, before penalties and temperature
            seq.logprobs.record(logits, token)
        sampled.setdefault(seq.request_id, []).append(token)
        seq.append(token)

    def emit_all(self, seq: Sequence, logits: np.ndarray, tokens: list[int], sampled: dict[str, list[int]]) -> int:
        """Append `tokens` (row j of `logits` drew token j) until `seq` finishes; how many it took."""
        for j, token in enumerate(tokens):
            if seq.is_finished:
                return j
            self.emit(seq, logits[j], token, sampled)
        return len(tokens)

    def outputs(self, running: list[Sequence], finished: list[Sequence],
                sampled: dict[str, list[int]]) -> list[StepOutput]:
        """The step's outputs, for every sequence that sampled or finished; finished ones give their KV back."""
        touched = [s for s in running if s.request_id in sampled or s.is_finished] + finished
        outputs = [self._output(s, sampled) for s in touched]
        with self.lock:
            for s in touched:
                if s.is_finished:
                    self.scheduler.release(s)
                    self._active.pop(s.request_id, None)
        return outputs

    def _output(self, s: Sequence, sampled: dict[str, list[int]]) -> StepOutput:
        logprobs = s.logprobs.take(self.tokenizer) if s.logprobs is not None else None
        if s.beam is not None and s.is_finished:  # a beam request: every beam, once, at the end
            beams = tuple(s.beam.results(self.tokenizer))
            return StepOutput(s.request_id, beams[0].token_ids if beams else [], s.take_text(), s.finish_reason, beams)
        return StepOutput(s.request_id, sampled.get(s.request_id, []), s.take_text(), s.finish_reason,
                          logprobs=logprobs)

