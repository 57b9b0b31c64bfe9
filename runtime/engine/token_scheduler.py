"""A token-budget scheduler over the paged KV cache: each step is one call of the graph that mixes
decode rows and prefill chunks.

    schedule() = every running sequence that decodes gets its next token (a new block when it
                 crosses into one; when the pool is out, the newest running sequence is preempted),
                 and with speculation up to `max_batch` of them the proposals after it
                 (speculation/speculator.py; with a draft model, blocks reserved for the proposals
                 speculation/draft.py fills in after scheduling) when the spare tokens and free blocks allow
                 and no more requests are in than `disable_batch_size`; a guided row whose grammar
                 forces its next tokens carries those instead (fast-forward, below)
               + partly prefilled sequences continue, oldest first
               + waiting sequences are admitted (their cached prefix reused) while rows, tokens
                 and blocks last
               all within `max_num_tokens` tokens (prompt tokens also within the caller's
               cap, step_cost.py) and `max_rows` rows

A sequence's pending tokens are those whose KV is not cached yet: `all_token_ids()[num_cached:]`.
A decoding sequence has one (the token it sampled last); a prefilling one its uncached prompt.
Preemption is by recompute (vLLM's default): the preempted sequence gives its blocks back and goes
to the front of the queue with its output so far, which becomes part of what it prefills when it
returns; its full blocks keep their prefix keys, so it usually finds them still cached. A running
sequence is never corrupted: it either has blocks for every token it writes or it is not run.
Rejected proposals roll back by the sequence's length not advancing past them (`computed`).
A LongRoPE sequence that grows past the switch recomputes its KV the same way, not counted as a
preemption (runtime/engine/longrope.py).

Fast-forward (`fast_forward`, on by default) and speculation add proposals after decode rows' last tokens
once every decode row has its blocks (speculation/proposals.py).

With LoRA adapters (`lora`, lora_slots.py) a waiting request is admitted only while the running sequences' distinct
adapters stay within `max_slots` (every step carries them all); one that does not fit waits, and the requests behind
it that fit are admitted past it, until it has waited too long (lora_slots.py: Admission). A running sequence holds
its adapter's weights until it stops running.

A beam request (runtime/engine/beam.py) is one sequence here that counts `beam_width` rows from its
admission on: it prefills its prompt as one row, then its beams decode as rows of their own, all
of them in the same step or none (they are scheduled together, with the blocks copy-on-write needs
taken first: the plan's `copies` lists the block copies the step must make before it runs). When
the pool runs out the group is preempted as a whole and restarts from its prompt: its beams stream
only at the end, so nothing was sent, and the search is deterministic, so it ends the same way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np

from llmc.runtime.engine import beam, longrope
from llmc.runtime.engine.block_manager import BlockManager
from llmc.runtime.engine.core import WaitingQueue
from llmc.runtime.engine.lora_slots import LoraSlots
from llmc.runtime.engine.sequence import FinishReason, Sequence, Status
from llmc.runtime.engine.speculation import proposals
from llmc.runtime.engine.speculation.speculator import Speculator, logit_rows, verify
from llmc.runtime.engine.step_plan import Chunk, StepPlan

if TYPE_CHECKING:
    from llmc.runtime.engine.core import EngineCore


class TokenScheduler(WaitingQueue):
    def __init__(self, blocks: BlockManager, *, max_rows: int, max_num_tokens: int, max_queue_size: int,
                 capacity: int, speculator: Speculator | None = None, fast_forward: bool = True,
                 lora: LoraSlots | None = None):
        super().__init__(max_queue_size)
        self.lora = lora
        self.blocks, self.max_rows, self.max_num_tokens = blocks, max_rows, max_num_tokens
        self.capacity, self.speculator, self.fast_forward = capacity, speculator, fast_forward
        self.running: list[Sequence] = []  # in admission order: the newest is preempted first
        self.num_preemptions = 0
        self.num_forced_tokens = 0  # fast-forwarded tokens the step verified and kept, since start

    def schedule(self, prompt_cap: Callable[[int], int | None] | None = None) -> StepPlan:
        """The step's plan (step_plan.py); `prompt_cap(decode rows)` may cap its prompt tokens further
        (step_cost.py). A sequence that finished while it was planned (alone in a pool it outgrew)
        has no row in it."""
        chunks: list[Chunk] = []
        copies: list[tuple[int, int]] = []  # (source, copy) blocks to copy before the step runs
        rows = self._decode_rows(chunks, copies)
        budget = self.max_num_tokens - sum(len(c.token_ids) + c.reserved for c in chunks)  # reserved: speculation/draft.py's
        prompts = self.waiting or any(seq.num_tokens - seq.num_cached > 1 for seq in self.running)
        cap = prompt_cap(rows) if prompt_cap is not None and prompts else None  # a fit: ~0.3 ms, not every step
        if cap is not None:
            budget = min(budget, cap)
        for seq in self.running:
            if budget <= 0:
                break
            if seq.num_tokens - seq.num_cached > 1 and not _forked(seq):
                budget -= self._chunk(seq, budget, chunks)
        at = 0  # the first waiting sequence not passed over (without adapters: always the head)
        admission = self.lora.admission() if self.lora is not None else None
        while at < len(self.waiting) and budget > 0:
            seq = self.waiting[at]
            if seq.is_finished:  # cancelled while waiting
                del self.waiting[at]
                continue
            if admission is not None and not admission.admits(seq, self.running):
                at += 1  # its adapter waits for a slot (or for one that waited too long); those behind it may fit
                continue
            if self.num_rows + seq.params.beam_width > self.max_rows or not self.blocks.can_allocate(seq):
                break
            del self.waiting[at]
            self.blocks.allocate(seq)
            if self.lora is not None:
                self.lora.hold(seq)
            seq.status = Status.prefilling
            self.running.append(seq)
            budget -= self._chunk(seq, budget, chunks)
        return StepPlan(self.blocks, [c for c in chunks if not c.seq.is_finished], copies)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_rows(self) -> int:
        """Rows the running sequences take: one each, a beam request its beam_width."""
        return sum(seq.params.beam_width for seq in self.running)

    def _decode_rows(self, chunks: list[Chunk], copies: list[tuple[int, int]]) -> int:
        """One token for every decoding sequence that keeps (or gets) its blocks; returns how many.
        A sequence that alone fills the whole pool ends (`length`), as a full KV slot does: preempted,
        it would only recompute its way back to the same place."""
        for seq in list(self.running):
            if seq in self.running and _forked(seq):
                self._beam_rows(seq, chunks, copies)
                continue
            if seq not in self.running or seq.num_tokens - seq.num_cached != 1:
                continue
            if longrope.must_recompute(self.blocks.longrope_switch, seq.long_rope, seq.num_tokens):
                self._restart(seq)  # its KV again with the long factors: it prefills when it is admitted
                continue
            while not self.blocks.can_append(seq) and seq in self.running:
                if len(self.running) == 1:  # only seq itself is left to give blocks back
                    seq.finish(FinishReason.length)
                    break
                self.preempt(self.running[-1])
            if seq in self.running and not seq.is_finished:
                self.blocks.append(seq)
                chunks.append(Chunk(seq, [seq.last_token_id], seq.num_cached))
        if self.fast_forward:
            proposals.fast_forward(chunks, self.blocks, self.max_num_tokens, self.capacity)
        if self.speculator is not None and len(self.running) + len(self.waiting) <= self.speculator.disable_batch_size:
            # (above it a full batch is compute-bound already; a draft would also catch up rows only to stop again)
            proposals.speculate(chunks, self.speculator, self.blocks, self.max_num_tokens)
        return len(chunks)

    def _beam_rows(self, seq: Sequence, chunks: list[Chunk], copies: list[tuple[int, int]]) -> None:
        """Every beam of `seq`, each with a block of its own for the position it writes (new, or a
        copy of the partial block it shares), or none of them: preempting the newest sequences
        until the blocks are there; alone in the pool it ends (`length`) with the beams it has."""
        rows = seq.beam.rows
        while self.blocks.write_cost(rows) > self.blocks.num_available and seq in self.running:
            if len(self.running) == 1:
                seq.finish(FinishReason.length)
                return
            self.preempt(self.running[-1])
        if seq in self.running:
            copies.extend(self.blocks.make_writable(rows))
            chunks.extend(Chunk(seq, [row.token_ids[-1]], row.num_cached, row=row) for row in rows)

    def _chunk(self, seq: Sequence, budget: int, chunks: list[Chunk]) -> int:
        tokens = seq.all_token_ids()[seq.num_cached:seq.num_cached + budget]
        chunks.append(Chunk(seq, list(tokens), seq.num_cached))
        return len(tokens)

    def preempt(self, seq: Sequence) -> None:
        """Take `seq`'s blocks back; it returns to the front of the queue and recomputes (a beam
        request from its prompt)."""
        if seq.beam is not None:
            beam.free(seq, self.blocks)
            seq.beam.restart()
        self._restart(seq)
        self.num_preemptions += 1

    def _restart(self, seq: Sequence) -> None:
        """`seq` gives its blocks back and goes to the front of the queue, to prefill all its tokens again."""
        self.blocks.free(seq)
        self.running.remove(seq)
        if self.lora is not None:
            self.lora.drop(seq)
        seq.status, seq.draft_cached = Status.waiting, 0
        self.waiting.appendleft(seq)

    def computed(self, chunk: Chunk, accepted: int = 0) -> None:
        """The graph wrote `chunk`: its tokens are cached, and its full blocks can serve as prefixes.
        Of its proposals only the `accepted` ones count: a rejected one's KV is left past the
        sequence's length (overwritten later, never committed) and the blocks taken for it go back."""
        written = chunk.row if chunk.row is not None else chunk.seq  # a beam's own length, or the sequence's
        written.num_cached = chunk.past_len + len(chunk.token_ids) - len(chunk.proposals) + accepted
        # the draft's KV past the accepted tokens holds rejected proposals: it rolls back the same way
        chunk.seq.draft_cached = min(chunk.seq.draft_cached, chunk.seq.num_cached)
        if chunk.proposals:
            self.blocks.trim(chunk.seq)
        self.blocks.commit(written)

    def release(self, seq: Sequence) -> None:
        if self.lora is not None:
            self.lora.drop(seq)
        if seq in self.running:
            self.running.remove(seq)
            if seq.beam is not None:
                beam.free(seq, self.blocks)
            self.blocks.free(seq)

    # -- a step's output --------------------------------------------------------------------------------

    def update_from_output(self, plan: StepPlan, logits: np.ndarray, core: "EngineCore",
                           sampled: dict[str, list[int]]) -> None:
        """Take the step's `logits` back: every sampling row of `plan` gets its token(s) (through `core`,
        into `sampled`) and every chunk is committed."""
        chunks = plan.chunks
        if any(c.seq.beam is not None for c in chunks):
            chunks, logits = self._beams(chunks, logits)
        if any(c.proposals for c in chunks):
            self._verify(chunks, logits, core, sampled)
            return
        for chunk in chunks:
            self.computed(chunk)
        rows = [i for i, c in enumerate(chunks) if c.samples]
        if rows:
            for i in rows:
                chunks[i].seq.status = Status.decoding
            core.sample([chunks[i].seq for i in rows], logits[rows], sampled)

    def _beams(self, chunks: list[Chunk], logits: np.ndarray) -> tuple[list[Chunk], np.ndarray]:
        """Advance the beam requests of the step (each from its rows' logits, in row order, or its
        prompt's); the other chunks and their logits rows are returned for the usual path."""
        spans = logit_rows([c.proposals for c in chunks])
        groups: dict[str, tuple[Sequence, list[int]]] = {}
        others, other_rows = [], []
        for i, chunk in enumerate(chunks):
            if chunk.seq.beam is None:
                others.append(chunk)
                other_rows.extend(spans[i])
                continue
            self.computed(chunk)
            if chunk.samples:
                groups.setdefault(chunk.seq.request_id, (chunk.seq, []))[1].append(spans[i][-1])
        for seq, rows in groups.values():
            seq.status = Status.decoding
            beam.advance(seq, logits[rows], self.blocks)
        return others, logits[other_rows]

    def _verify(self, chunks: list[Chunk], logits: np.ndarray, core: "EngineCore",
                sampled: dict[str, list[int]]) -> None:
        """A step with proposals: each sampling row keeps the tokens verify() gives it; a row's
        length (and its committed KV) advances over its accepted proposals only."""
        spans = logit_rows([c.proposals for c in chunks])
        rows = [i for i, c in enumerate(chunks) if c.samples and (c.seq.guide is None or c.proposals)]
        guided = [i for i, c in enumerate(chunks) if c.samples and c.seq.guide is not None and not c.proposals]
        for chunk in chunks:
            if not chunk.samples or chunk.seq.guide is not None and not chunk.proposals:
                self.computed(chunk)
        if guided:  # guided rows without proposals: one token each, as without speculation
            for i in guided:
                chunks[i].seq.status = Status.decoding
            core.sample([chunks[i].seq for i in guided], logits[[spans[i][-1] for i in guided]], sampled)
        if not rows:
            return
        picked = np.concatenate([spans[i] for i in rows])
        kept = verify(logits[picked], [chunks[i].seq for i in rows], [chunks[i].proposals for i in rows],
                      [chunks[i].draft for i in rows], core.end_ids)
        at = 0
        for i, tokens in zip(rows, kept):
            chunk = chunks[i]
            chunk.seq.status = Status.decoding
            emitted = core.emit_all(chunk.seq, logits[picked[at:at + len(tokens)]], tokens, sampled)
            at += 1 + len(chunk.proposals)
            accepted = min(len(tokens) - 1, emitted)
            self.computed(chunk, accepted=accepted)
            if chunk.forced:
                self.num_forced_tokens += accepted
            elif chunk.proposals:
                self.speculator.count(len(chunk.proposals), len(tokens) - 1)


def _forked(seq: Sequence) -> bool:
    """A beam request whose beams are running (its prompt is in their blocks)."""
    return seq.beam is not None and bool(seq.beam.rows)
