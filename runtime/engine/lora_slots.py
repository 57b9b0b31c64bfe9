"""The scheduler's side of LoRA adapters (docs/lora.md): a step carries at most `max_slots` distinct adapters, and a
running sequence holds its adapter's weights in the store (runtime/lora/store.py), so it is never evicted under it.

A waiting request whose adapter is neither among the running sequences' nor fits a free slot (or whose weights
cannot be brought into host memory now: every adapter there is held) waits, and requests behind it that fit (the
base model's, or an adapter already running) go first. Every running sequence decodes each step, so the running
sequences' distinct adapters are every step's.

A sequence holds its adapter from admission until it finishes, is cancelled or is preempted (it holds it again
when it is admitted again).
"""

from __future__ import annotations

from typing import Iterable

from llmc.runtime.engine.sequence import Sequence
from llmc.runtime.lora.store import AdapterStore


class LoraSlots:
    def __init__(self, store: AdapterStore, max_slots: int, max_rank: int = 64):
        """`max_rank`: lora.max_rank, the highest rank an adapter loaded at run time may have."""
        if not 1 <= max_slots <= store.capacity:
            raise ValueError(f"max_slots ({max_slots}) must be between 1 and the store's capacity "
                             f"({store.capacity}, lora.max_host_adapters)")
        self.store, self.max_slots, self.max_rank = store, max_slots, max_rank

    def fits(self, seq: Sequence, running: Iterable[Sequence]) -> bool:
        """Whether `seq` can join the running sequences without a step carrying more than `max_slots` adapters."""
        if seq.adapter is None:
            return True
        in_use = {s.adapter for s in running if s.adapter is not None}
        if seq.adapter in in_use:
            return True
        return len(in_use) < self.max_slots and self.store.can_pin(seq.adapter)

    def hold(self, seq: Sequence) -> None:
        """`seq` is admitted: its adapter's weights, pinned in the store, go with its rows."""
        if seq.adapter is not None and seq.lora is None:
            seq.lora = self.store.pin(seq.adapter)

    def drop(self, seq: Sequence) -> None:
        """`seq` stops running (finished, cancelled, preempted): its hold on the adapter ends."""
        if seq.lora is not None:
            seq.lora = None
            self.store.unpin(seq.adapter)
