"""The engine over a slot graph's KV cache (a slot per request): one batched step at a time.

What it still serves: graphs built without a paged KV cache, which are the TensorRT builds (the
TensorRT runner has slots, trt.py) and the `fused`/`reference` attention exports kept as baselines.
It goes once a paged TensorRT runner exists: then every target runs PagedEngine.

    step() = cancel -> admit -> prefill one sequence (a chunk of its prompt) -> decode every
             decoding sequence in one batch -> sample -> stream -> release finished slots

Prefill runs one sequence per step (ONNX Runtime's GroupQueryAttention takes one row when a step
has several tokens and a past; the layout records it) in chunks of at most `max_num_tokens`, so a
long prompt cannot stall the running batch for long. Decode runs the contiguous slot range that
holds the decoding sequences; free or still-prefilling slots inside it ride along as dummy rows
that write only where nothing will be read (position 0 of a free slot, or the position a
prefilling sequence will overwrite next). A LongRoPE model's rows carry their sequences' lengths, and
a sequence that grows past the switch prefills prompt and output again in its slot
(runtime/engine/longrope.py). With `lora` (lora_slots.py: the adapter store and lora.max_slots) a request may name a
LoRA adapter, as on the paged engine: an unknown name is refused before anything runs, the scheduler caps the running
sequences' distinct adapters, and each row carries its sequence's adapter weights to the runner (a dummy row none).
The model is a `Runner` (runtime/runners/protocol.py): its `rows`
are the slots, its `capacity` the longest sequence. The requests are the `EngineCore`'s (core.py):
`add_request` and `cancel` may be called from other threads; `step` belongs to one loop thread.
"""

from __future__ import annotations

import numpy as np

from llmc.runtime.decoding.grammar import GuideMatcher
from llmc.runtime.decoding.sampling import SamplingParams
from llmc.runtime.engine import longrope
from llmc.runtime.engine.core import CacheState, EngineCore, StepOutput
from llmc.runtime.engine.lora_slots import LoraSlots
from llmc.runtime.engine.sequence import FinishReason, Sequence, Status
from llmc.runtime.engine.slot_scheduler import Scheduler
from llmc.runtime.lora.store import UnknownAdapter
from llmc.runtime.runners.protocol import Runner


class SlotEngine:
    def __init__(self, runner: Runner, tokenizer=None, *, end_ids: tuple[int, ...] = (), max_queue_size: int = 256,
                 max_num_tokens: int = 8192, lora: LoraSlots | None = None):
        """`lora`: the adapters a request may name; the runner must hold the LoRA graph (its `lora`)."""
        if lora is not None and getattr(runner, "lora", None) is None:
            raise ValueError("LoRA adapters need a runner with the LoRA graph")
        self.runner, self.max_num_tokens, self.lora = runner, max_num_tokens, lora
        self.longrope_switch = runner.layout.longrope_switch  # LongRoPE models only (longrope.py)
        self.scheduler = Scheduler(runner.rows, max_queue_size, lora)
        # the slot graph runs no beams: beam_width above 1 is refused
        self.core = EngineCore(self.scheduler, tokenizer, end_ids=end_ids, capacity=runner.capacity)

    @property
    def end_ids(self) -> tuple[int, ...]:
        return self.core.end_ids

    @property
    def has_work(self) -> bool:
        return self.core.has_work

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    logprobs: int | None = None, guide: GuideMatcher | None = None,
                    adapter: str | None = None) -> Sequence:
        """Queue a request; raises ValueError for a request that cannot run and QueueFull when busy.
        `logprobs`: record its tokens' log probabilities with that many alternatives (logprobs.py);
        `guide`: constrain its tokens to a compiled grammar (grammar.py); `adapter`: the name of the LoRA adapter it runs
        under (None: the base model; UnknownAdapter for one the model does not serve)."""
        if adapter is not None and self.lora is None:
            raise UnknownAdapter(f"lora_name: this model serves no LoRA adapters (got {adapter!r})")
        ref = self.lora.store.resolve(adapter) if adapter is not None else None
        return self.core.queue(self.core.sequence(request_id, prompt_ids, params, logprobs, guide, ref))

    def idle(self) -> None:
        """Nothing to do between requests: a slot runner's LoRA stacks follow each step's adapters (runtime/lora/
        stacks.py: StepStacks), so there is no slot to fill ahead of a request."""

    def adapter_users(self, name: str) -> tuple[int, int]:
        """(running, queued) requests under the LoRA adapter `name` (any digest): what an unload waits for."""
        return self.core.adapter_users(name)

    def cancel(self, request_id: str) -> None:
        """Stop a request at the next step; its slot is freed then."""
        self.core.cancel(request_id)

    def abort_all(self) -> None:
        """Drop every request (after a failed step, whose state cannot be trusted); slots are freed."""
        self.core.abort_all()

    def cache_state(self) -> CacheState:
        s = self.scheduler
        return CacheState(s.num_running, s.num_waiting, s.num_running / self.runner.rows)

    def close(self) -> None:
        """Free the model and its KV cache (no step may be running)."""
        self.runner.close()

    def step(self) -> list[StepOutput]:
        with self.core.lock:
            finished = self.core.take_cancelled()
            self.scheduler.admit()
        sampled: dict[str, list[int]] = {}
        seq = self.scheduler.next_prefill()
        if seq is not None:
            self._prefill(seq, sampled)
        self._decode(self.scheduler.decoding(), sampled)
        return self.core.outputs(list(self.scheduler.running.values()), finished, sampled)

    def _prefill(self, seq: Sequence, sampled: dict[str, list[int]]) -> None:
        """A chunk of the tokens `seq` has not cached: its prompt, or all of it again (longrope.py)."""
        if seq.num_cached == 0:
            seq.long_rope = longrope.is_long(self.longrope_switch, seq.num_tokens)
        chunk = seq.all_token_ids()[seq.num_cached:seq.num_cached + self.max_num_tokens]
        lengths = None if self.longrope_switch is None else np.array([seq.num_tokens])
        logits = self.runner.step(np.array([chunk]), np.array([seq.num_cached]), first_row=seq.slot,
                                  sequence_lengths=lengths, **self._adapters([seq]))
        seq.num_cached += len(chunk)
        if seq.num_cached == seq.num_tokens:
            seq.status = Status.decoding
            self.core.sample([seq], logits[0, -1:], sampled)

    def _decode(self, seqs: list[Sequence], sampled: dict[str, list[int]]) -> None:
        for seq in seqs:
            if not seq.is_finished and seq.num_cached >= self.core.capacity:
                seq.finish(FinishReason.length)  # the KV slot is full
            elif longrope.must_recompute(self.longrope_switch, seq.long_rope, seq.num_tokens):
                seq.num_cached, seq.status = 0, Status.prefilling  # grown past the switch: prefills again
        seqs = [s for s in seqs if not s.is_finished and s.status is Status.decoding]
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
        lengths = None
        if self.longrope_switch is not None:  # a dummy row's any length past its position
            lengths = positions + 1
            for seq in seqs:
                lengths[seq.slot - first] = seq.num_tokens
        rows: list[Sequence | None] = [None] * (last - first + 1)  # a dummy row runs under no adapter
        for seq in seqs:
            rows[seq.slot - first] = seq
        logits = self.runner.step(ids, positions, first_row=first, sequence_lengths=lengths, **self._adapters(rows))
        for seq in seqs:
            seq.num_cached += 1
        self.core.sample(seqs, logits[[s.slot - first for s in seqs], -1], sampled)

    def _adapters(self, rows: list[Sequence | None]) -> dict:
        """The runner's `adapters` argument for a step of `rows` (none without LoRA: runners without it lack it)."""
        if self.lora is None:
            return {}
        return {"adapters": [seq.lora if seq is not None else None for seq in rows]}
