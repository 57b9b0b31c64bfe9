"""The engine: requests in, token ids and text out, one batched step at a time.

    step() = cancel -> admit -> prefill one sequence (a chunk of its prompt) -> decode every
             decoding sequence in one batch -> sample -> stream -> release finished slots

Prefill runs one sequence per step (ONNX Runtime's GroupQueryAttention takes one row when a step
has several tokens and a past; the layout records it) in chunks of at most `max_num_tokens`, so a
long prompt cannot stall the running batch for long. Decode runs the contiguous slot range that
holds the decoding sequences; free or still-prefilling slots inside it ride along as dummy rows
that write only where nothing will be read (position 0 of a free slot, or the position a
prefilling sequence will overwrite next). The model is a `Runner` (runtime/runners/protocol.py): its `rows`
are the slots, its `capacity` the longest sequence. `add_request` and `cancel` may be called from
other threads; `step` belongs to one loop thread.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from llmc.runtime.decoding.detokenizer import IncrementalDetokenizer
from llmc.runtime.decoding.logprobs import LogprobRecorder
from llmc.runtime.runners.protocol import Runner
from llmc.runtime.decoding.sampling import SamplingParams, sample_rows
from llmc.runtime.engine.slot_scheduler import Scheduler
from llmc.runtime.engine.sequence import FinishReason, Sequence, Status


@dataclass(frozen=True)
class StepOutput:
    request_id: str
    token_ids: list[int]  # sampled this step (empty for a cancelled request)
    text: str  # text made final this step
    finish_reason: FinishReason | None
    beams: tuple | None = None  # a finished beam request's beams, best first (runtime/engine/beam.py's Beam)

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


class LLMEngine:
    max_beam_width = 1  # the slot graph runs no beams (the paged engine's limit is serving.max_beam_width)

    def __init__(self, runner: Runner, tokenizer=None, *, end_ids: tuple[int, ...] = (), max_queue_size: int = 256,
                 max_num_tokens: int = 8192):
        self._setup(runner, tokenizer, end_ids, runner.capacity, max_num_tokens, Scheduler(runner.rows, max_queue_size))

    def _setup(self, runner, tokenizer, end_ids: tuple[int, ...], capacity: int, max_num_tokens: int, scheduler) -> None:
        """What every engine holds: the runner, the scheduler over its KV cache, and the requests."""
        self.runner, self.tokenizer, self.end_ids = runner, tokenizer, tuple(end_ids)
        self.capacity, self.max_num_tokens, self.scheduler = capacity, max_num_tokens, scheduler
        self._lock = threading.Lock()
        self._active: dict[str, Sequence] = {}
        self._cancelled: list[Sequence] = []

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    logprobs: LogprobRecorder | None = None) -> Sequence:
        """Queue a request; raises ValueError for a request that cannot run and QueueFull when busy.
        `logprobs` records the log probabilities of its tokens (runtime/decoding/logprobs.py)."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) >= self.capacity:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens; at most {self.capacity - 1} fit max_seq_len "
                             f"({self.capacity}) with room to generate")
        if params.beam_width > self.max_beam_width:
            raise ValueError(f"beam_width: {params.beam_width} is above this model's limit of {self.max_beam_width} "
                             f"(serving.max_beam_width)")
        if not params.end_ids and self.end_ids:
            params = params.model_copy(update={"end_ids": self.end_ids})
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids) if self.tokenizer is not None else None
        seq = Sequence(request_id, list(prompt_ids), params, detokenizer=detok, logprobs=logprobs)
        self._prepare(seq)
        with self._lock:
            if request_id in self._active:
                raise ValueError(f"request id {request_id!r} is already running")
            self.scheduler.add(seq)
            self._active[request_id] = seq
        return seq

    def _prepare(self, seq: Sequence) -> None:
        """What a new sequence gets before it is queued (the paged engine: a beam request's search)."""

    def cancel(self, request_id: str) -> None:
        """Stop a request at the next step; its slot is freed then."""
        with self._lock:
            seq = self._active.get(request_id)
            if seq is not None:
                self._cancelled.append(seq)

    def abort_all(self) -> None:
        """Drop every request (after a failed step, whose state cannot be trusted); slots are freed."""
        with self._lock:
            for seq in self._active.values():
                seq.finish(FinishReason.cancelled)
                self.scheduler.drop_waiting(seq)
                self.scheduler.release(seq)
            self._active.clear()
            self._cancelled.clear()

    def cache_state(self) -> CacheState:
        s = self.scheduler
        return CacheState(s.num_running, s.num_waiting, s.num_running / self.runner.rows)

    @property
    def has_work(self) -> bool:
        return bool(self._active)

    def close(self) -> None:
        """Free the model and its KV cache (no step may be running)."""
        self.runner.close()

    def step(self) -> list[StepOutput]:
        with self._lock:
            finished = self._apply_cancellations()
            self.scheduler.admit()
        sampled: dict[str, list[int]] = {}
        seq = self.scheduler.next_prefill()
        if seq is not None:
            self._prefill(seq, sampled)
        self._decode(self.scheduler.decoding(), sampled)
        return self._outputs(list(self.scheduler.running.values()), finished, sampled)

    def _outputs(self, running: list[Sequence], finished: list[Sequence],
                 sampled: dict[str, list[int]]) -> list[StepOutput]:
        """The step's outputs, for every sequence that sampled or finished; finished ones give their KV back."""
        touched = [s for s in running if s.request_id in sampled or s.is_finished] + finished
        outputs = [self._output(s, sampled) for s in touched]
        with self._lock:
            for s in touched:
                if s.is_finished:
                    self.scheduler.release(s)
                    self._active.pop(s.request_id, None)
        return outputs

    def _output(self, s: Sequence, sampled: dict[str, list[int]]) -> StepOutput:
        if s.beam is not None and s.is_finished:  # a beam request: every beam, once, at the end
            beams = tuple(s.beam.results(self.tokenizer))
            return StepOutput(s.request_id, beams[0].token_ids if beams else [], s.take_text(), s.finish_reason, beams)
        return StepOutput(s.request_id, sampled.get(s.request_id, []), s.take_text(), s.finish_reason)

    def _apply_cancellations(self) -> list[Sequence]:
        cancelled, self._cancelled = self._cancelled, []
        for seq in cancelled:
            seq.finish(FinishReason.cancelled)
            self.scheduler.drop_waiting(seq)
            self.scheduler.release(seq)  # before admitting: a waiting request takes the slot this step
        return [s for s in cancelled if s.finish_reason is FinishReason.cancelled]

    def _sample(self, seqs: list[Sequence], logits: np.ndarray, sampled: dict[str, list[int]]) -> None:
        """The next token of each sequence from its row of `logits` [len(seqs), V], in one pass."""
        tokens = sample_rows(logits, [s.params for s in seqs], [s.prompt_array() for s in seqs],
                             [s.output_ids for s in seqs], [s.rng for s in seqs]).tolist()
        for seq, row, token in zip(seqs, logits, tokens):
            self._emit(seq, row, token, sampled)

    @staticmethod
    def _emit(seq: Sequence, logits: np.ndarray, token: int, sampled: dict[str, list[int]]) -> None:
        """`token`, drawn from the row `logits`, becomes `seq`'s next token."""
        if seq.logprobs is not None:  # from the raw logits, before penalties and temperature
            seq.logprobs.record(logits, token)
        sampled.setdefault(seq.request_id, []).append(token)
        seq.append(token)

    def _prefill(self, seq: Sequence, sampled: dict[str, list[int]]) -> None:
        chunk = seq.prompt_ids[seq.num_cached:seq.num_cached + self.max_num_tokens]
        logits = self.runner.step(np.array([chunk]), np.array([seq.num_cached]), first_row=seq.slot)
        seq.num_cached += len(chunk)
        if seq.num_cached == len(seq.prompt_ids):
            seq.status = Status.decoding
            self._sample([seq], logits[0, -1:], sampled)

    def _decode(self, seqs: list[Sequence], sampled: dict[str, list[int]]) -> None:
        for seq in seqs:
            if not seq.is_finished and seq.num_cached >= self.capacity:
                seq.finish(FinishReason.length)  # the KV slot is full
        seqs = [s for s in seqs if not s.is_finished]
        if not seqs:
            return
        first, last = seqs[0].slot, seqs[-1].slot
        ids = np.zeros((last - first + 1, 1), dtype=np.int64)
        positions = np.zeros(last - first + 1, dtype=np.int64)
        for slot in range(first, last + 1):  # dummy rows write where nothing will be read
            other = self.scheduler.running.get(slot)
            if other is not None and other.status is Status.prefilling:
                positions[slot - first] = other.num_cached
        for seq in seqs:
            ids[seq.slot - first, 0], positions[seq.slot - first] = seq.output_ids[-1], seq.num_cached
        logits = self.runner.step(ids, positions, first_row=first)
        for seq in seqs:
            seq.num_cached += 1
        self._sample(seqs, logits[[s.slot - first for s in seqs], -1], sampled)
