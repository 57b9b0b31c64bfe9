"""Iteration-level (in-flight) batching over a fixed set of KV slots.

Each KV slot (a row of the runner's cache buffers) holds one running sequence. Waiting sequences
take the lowest free slot as soon as one frees up, so they join the running batch at the next
step, and a finished or cancelled sequence gives its slot back at once. Keeping slots low keeps
the decode batch (a contiguous row range, free slots inside it riding along as dummy rows) short.
With LoRA adapters (`lora`, lora_slots.py) a waiting request is admitted only while the running sequences' distinct
adapters stay within `max_slots`; one that does not fit waits, and those behind it that fit go first, until it has
waited too long (lora_slots.py: Admission). A running sequence holds its adapter's weights until it stops running.
"""

from __future__ import annotations

import heapq

from llmc.runtime.engine.core import WaitingQueue
from llmc.runtime.engine.lora_slots import LoraSlots
from llmc.runtime.engine.sequence import Sequence, Status


class Scheduler(WaitingQueue):
    def __init__(self, max_batch_size: int, max_queue_size: int, lora: LoraSlots | None = None):
        super().__init__(max_queue_size)
        self.running: dict[int, Sequence] = {}  # slot -> sequence
        self._free = list(range(max_batch_size))  # a heap: the lowest free slot first
        self.lora = lora

    def admit(self) -> None:
        at = 0  # the first waiting sequence not passed over (without adapters: always the head)
        admission = self.lora.admission() if self.lora is not None else None
        while at < len(self.waiting) and self._free:
            seq = self.waiting[at]
            if seq.is_finished:  # cancelled while waiting
                del self.waiting[at]
                continue
            if admission is not None and not admission.admits(seq, self.running.values()):
                at += 1  # its adapter waits for a slot (or for one that waited too long); those behind it may fit
                continue
            del self.waiting[at]
            if self.lora is not None:
                self.lora.hold(seq)
            seq.slot, seq.status = heapq.heappop(self._free), Status.prefilling
            self.running[seq.slot] = seq

    @property
    def num_running(self) -> int:
        return len(self.running)

    def next_prefill(self) -> Sequence | None:
        """The running sequence whose prompt is not fully cached yet, lowest slot first."""
        pending = [s for s in self.running.values() if s.status is Status.prefilling]
        return min(pending, key=lambda s: s.slot) if pending else None

    def decoding(self) -> list[Sequence]:
        return sorted((s for s in self.running.values() if s.status is Status.decoding), key=lambda s: s.slot)

    def release(self, seq: Sequence) -> None:
        if seq.slot is not None and self.running.get(seq.slot) is seq:
            del self.running[seq.slot]
            heapq.heappush(self._free, seq.slot)
        seq.slot = None
        if self.lora is not None:
            self.lora.drop(seq)
