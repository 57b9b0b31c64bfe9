"""The scheduler's side of LoRA adapters (docs/lora.md): a step carries at most `max_slots` distinct adapters, and a
running sequence holds its adapter's weights in the store (runtime/lora/store.py), so it is never evicted under it.

A waiting request whose adapter is neither among the running sequences' nor fits a free slot (or whose weights
cannot be brought into host memory now: every adapter there is held) waits, and requests behind it that fit (the
base model's, or an adapter already running) go first. Every running sequence decodes each step, so the running
sequences' distinct adapters are every step's.

So that it does not wait forever while requests for the running adapters keep their slots busy, a request passed
over by `starved_after` schedules (steps) stops the admission of every request behind it that would hold an adapter
(`Admission`): the running adapters drain, the first to finish frees its slot, and the waiting request takes
it. The base model's requests still pass it; they hold no slot. (vLLM's scheduler passes such a request over for as
long as the slots stay busy.)

A sequence holds its adapter from admission until it finishes, is cancelled or is preempted (it holds it again
when it is admitted again).

An adapter loaded while the model serves (runtime/serving/lora_admin.py) is `loaded` here, and written into a slot
of the runner's LoRA graph the next time the engine has no work (`stage`, runtime/runners/paged_lora.py), so its first
request finds it bound.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable

from llmc.runtime.engine.sequence import Sequence
from llmc.runtime.lora.stacks import AdapterRef
from llmc.runtime.lora.store import AdapterStore, UnknownAdapter


STARVED_AFTER = 100  # schedules a request may be passed over for a slot before adapters behind it wait for it


class LoraSlots:
    def __init__(self, store: AdapterStore, max_slots: int, max_rank: int = 64, starved_after: int = STARVED_AFTER):
        """`max_rank`: lora.max_rank, the highest rank an adapter loaded at run time may have."""
        if not 1 <= max_slots <= store.capacity:
            raise ValueError(f"max_slots ({max_slots}) must be between 1 and the store's capacity "
                             f"({store.capacity}, lora.max_host_adapters)")
        self.store, self.max_slots, self.max_rank = store, max_slots, max_rank
        self.starved_after = starved_after
        # adapters loaded at run time, not yet staged (appended by a request thread); no more than a step's slots
        self._loaded: deque = deque(maxlen=max_slots)

    def fits(self, seq: Sequence, running: Iterable[Sequence]) -> bool:
        """Whether `seq` can join the running sequences without a step carrying more than `max_slots` adapters."""
        if seq.adapter is None:
            return True
        in_use = {s.adapter for s in running if s.adapter is not None}
        if seq.adapter in in_use:
            return True
        return len(in_use) < self.max_slots and self.store.can_pin(seq.adapter)

    def admission(self) -> "Admission":
        """One schedule's admission of waiting requests, in queue order."""
        return Admission(self)

    def hold(self, seq: Sequence) -> None:
        """`seq` is admitted: its adapter's weights, pinned in the store, go with its rows."""
        if seq.adapter is not None and seq.lora is None:
            seq.lora = self.store.pin(seq.adapter)

    def drop(self, seq: Sequence) -> None:
        """`seq` stops running (finished, cancelled, preempted): its hold on the adapter ends."""
        if seq.lora is not None:
            seq.lora = None
            self.store.unpin(seq.adapter)

    def loaded(self, ref: AdapterRef) -> None:
        """`ref` was loaded while the model serves (any thread): stage it when the engine next has no work."""
        self._loaded.append(ref)

    def stage(self, graph) -> None:
        """Write the adapters loaded since the last call into slots of `graph` (the runner's LoraGraph), on the engine's
        thread with no request running; one unloaded or evicted from host memory meanwhile is skipped."""
        while self._loaded:
            ref = self._loaded.popleft()
            if ref not in self.store.resident:
                continue
            try:
                weights = self.store.pin(ref)
            except (UnknownAdapter, RuntimeError):  # unloaded or pushed out between the check and the pin
                continue
            try:
                graph.stage(weights)
            finally:
                self.store.unpin(ref)


class Admission:
    """Which waiting requests one schedule admits, asked in queue order: those that fit (LoraSlots.fits), until one
    passed over has waited `starved_after` schedules; behind it, only the base model's."""

    def __init__(self, slots: LoraSlots):
        self.slots, self.starved = slots, False

    def admits(self, seq: Sequence, running: Iterable[Sequence]) -> bool:
        if not self.slots.fits(seq, running):
            seq.lora_passes += 1
            self.starved = self.starved or seq.lora_passes >= self.slots.starved_after
            return False
        return seq.adapter is None or not self.starved
