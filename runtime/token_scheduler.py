"""A token-budget scheduler over the paged KV cache: each step is one call of the graph that mixes
decode rows and prefill chunks.

    schedule() = every running sequence that decodes gets its next token (a new block when it
                 crosses into one; when the pool is out, the newest running sequence is preempted),
                 and with speculation up to `max_batch` of them the proposals after it
                 (speculative.py; with a draft model, blocks reserved for the proposals
                 draft.py fills in after scheduling) when the spare tokens and free blocks allow
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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from llmc.runtime.block_manager import BlockManager
from llmc.runtime.scheduler import WaitingQueue
from llmc.runtime.sequence import FinishReason, Sequence, Status
from llmc.runtime.speculative import Speculator


@dataclass(frozen=True)
class Chunk:
    """What one sequence feeds the graph this step: `token_ids` at positions `past_len`.., of which
    the last `len(proposals)` are proposed tokens to verify (speculative.py)."""

    seq: Sequence
    token_ids: list[int]
    past_len: int
    proposals: list[int] = field(default_factory=list)
    reserved: int = 0  # draft model: positions past the last token given blocks for the draft to fill (draft.py)
    draft: Any = None  # draft model, sampling row: the draft's distributions [k, V] the proposals came from

    @property
    def samples(self) -> bool:
        """The chunk reaches the sequence's last token, so its logits give the next token."""
        return self.past_len + len(self.token_ids) - len(self.proposals) == self.seq.num_tokens


class TokenScheduler(WaitingQueue):
    def __init__(self, blocks: BlockManager, *, max_rows: int, max_num_tokens: int, max_queue_size: int,
                 speculator: Speculator | None = None):
        super().__init__(max_queue_size)
        self.blocks, self.max_rows, self.max_num_tokens = blocks, max_rows, max_num_tokens
        self.speculator = speculator
        self.running: list[Sequence] = []  # in admission order: the newest is preempted first
        self.num_preemptions = 0

    def schedule(self, prompt_cap: Callable[[int], int | None] | None = None) -> list[Chunk]:
        """The step's chunks; `prompt_cap(decode rows)` may cap its prompt tokens further (step_cost.py)."""
        chunks: list[Chunk] = []
        rows = self._decode_rows(chunks)
        budget = self.max_num_tokens - sum(len(c.token_ids) + c.reserved for c in chunks)  # reserved: draft.py's
        cap = prompt_cap(rows) if prompt_cap is not None else None
        if cap is not None:
            budget = min(budget, cap)
        for seq in self.running:
            if budget <= 0:
                break
            if seq.num_tokens - seq.num_cached > 1:
                budget -= self._chunk(seq, budget, chunks)
        while self.waiting and budget > 0 and len(self.running) < self.max_rows:
            seq = self.waiting[0]
            if seq.is_finished:  # cancelled while waiting
                self.waiting.popleft()
                continue
            if not self.blocks.can_allocate(seq):
                break
            self.waiting.popleft()
            self.blocks.allocate(seq)
            seq.status = Status.prefilling
            self.running.append(seq)
            budget -= self._chunk(seq, budget, chunks)
        return chunks

    def _decode_rows(self, chunks: list[Chunk]) -> int:
        """One token for every decoding sequence that keeps (or gets) its blocks; returns how many.
        A sequence that alone fills the whole pool ends (`length`), as a full KV slot does: preempted,
        it would only recompute its way back to the same place."""
        for seq in list(self.running):
            if seq not in self.running or seq.num_tokens - seq.num_cached != 1:
                continue
            while not self.blocks.can_append(seq) and seq in self.running:
                if len(self.running) == 1:  # only seq itself is left to give blocks back
                    seq.finish(FinishReason.length)
                    break
                self.preempt(self.running[-1])
            if seq in self.running and not seq.is_finished:
                self.blocks.append(seq)
                chunks.append(Chunk(seq, [seq.all_token_ids()[-1]], seq.num_cached))
        if self.speculator is not None:
            self._speculate(chunks)
        return len(chunks)

    def _speculate(self, chunks: list[Chunk]) -> None:
        """Proposals after the last token of at most `max_batch` decode rows (the oldest that have
        any), within the step's spare tokens and the free blocks. Run once every decode row has its
        blocks, so speculation never takes a block a row needs for its own token, nor preempts anyone."""
        spare, rows = self.max_num_tokens - len(chunks), 0
        for i, chunk in enumerate(chunks):
            if spare < 1 or rows == self.speculator.max_batch:
                break
            if self.speculator.drafts:  # blocks for the most the draft may propose; it fills them after scheduling
                limit = self.speculator.limit(chunk.seq, spare)
                if limit and self.blocks.can_append(chunk.seq, limit):
                    self.blocks.append(chunk.seq, limit)
                    chunks[i] = Chunk(chunk.seq, chunk.token_ids, chunk.past_len, reserved=limit)
                    spare, rows = spare - limit, rows + 1
                continue
            proposals = self.speculator.propose(chunk.seq, spare)
            if proposals and self.blocks.can_append(chunk.seq, len(proposals)):
                self.blocks.append(chunk.seq, len(proposals))
                chunks[i] = Chunk(chunk.seq, chunk.token_ids + proposals, chunk.past_len, proposals)
                spare, rows = spare - len(proposals), rows + 1

    def _chunk(self, seq: Sequence, budget: int, chunks: list[Chunk]) -> int:
        tokens = seq.all_token_ids()[seq.num_cached:seq.num_cached + budget]
        chunks.append(Chunk(seq, list(tokens), seq.num_cached))
        return len(tokens)

    def preempt(self, seq: Sequence) -> None:
        """Take `seq`'s blocks back; it returns to the front of the queue and recomputes."""
        self.blocks.free(seq)
        self.running.remove(seq)
        seq.status, seq.draft_cached = Status.waiting, 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def computed(self, chunk: Chunk, accepted: int = 0) -> None:
        """The graph wrote `chunk`: its tokens are cached, and its full blocks can serve as prefixes.
        Of its proposals only the `accepted` ones count: a rejected one's KV is left past the
        sequence's length (overwritten later, never committed) and the blocks taken for it go back."""
        chunk.seq.num_cached = chunk.past_len + len(chunk.token_ids) - len(chunk.proposals) + accepted
        # the draft's KV past the accepted tokens holds rejected proposals: it rolls back the same way
        chunk.seq.draft_cached = min(chunk.seq.draft_cached, chunk.seq.num_cached)
        if chunk.proposals:
            self.blocks.trim(chunk.seq)
        self.blocks.commit(chunk.seq)

    def release(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
            self.blocks.free(seq)
