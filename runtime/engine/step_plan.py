"""One paged step's work list, held by one object from scheduling until what the graph wrote is
committed (the shape of vLLM v1's SchedulerOutput -> execute_model -> update_from_output):

    TokenScheduler.schedule() -> StepPlan: a chunk per row, the copy-on-write block copies, the
        rows with blocks reserved for a draft model's proposals
    DraftProposer.fill(plan) -> plan.propose(i, ...) / plan.withdraw(i) on the reserved rows
    runner.copy_blocks(plan.copies); runner.step(plan.row_steps()) -> logits
    plan.update_from_output(logits, core, sampled) -> beam groups advance (beam.py), proposals are
        verified (speculation/speculator.py), the other sampling rows sample; each chunk is committed

Only the plan changes its chunks; the draft proposer and the engine go through its methods.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np

from llmc.runtime.engine import beam
from llmc.runtime.engine.beam import BeamRow
from llmc.runtime.engine.sequence import Sequence, Status
from llmc.runtime.engine.speculation.speculator import logit_rows, verify
from llmc.runtime.runners.paged_batch import RowStep

if TYPE_CHECKING:
    from llmc.runtime.engine.core import EngineCore
    from llmc.runtime.engine.token_scheduler import TokenScheduler


@dataclass(frozen=True)
class Chunk:
    """What one sequence feeds the graph this step: `token_ids` at positions `past_len`.., of which
    the last `len(proposals)` are proposed tokens to verify (speculation/speculator.py); or, with `row`, one
    beam of a beam request: that beam's last token."""

    seq: Sequence
    token_ids: list[int]
    past_len: int
    proposals: list[int] = field(default_factory=list)
    reserved: int = 0  # draft model: positions past the last token given blocks for the draft to fill (speculation/draft.py)
    draft: Any = None  # draft model, sampling row: the draft's distributions [k, V] the proposals came from
    forced: bool = False  # the proposals are tokens the row's grammar forces (fast-forward), not guesses
    row: BeamRow | None = None  # one beam of a beam request (beam.py)

    @property
    def samples(self) -> bool:
        """The chunk reaches the sequence's last token, so its logits give the next token."""
        if self.row is not None:
            return True
        return self.past_len + len(self.token_ids) - len(self.proposals) == self.seq.num_tokens

    @property
    def block_ids(self) -> list[int]:
        return self.row.block_ids if self.row is not None else self.seq.block_ids


class StepPlan:
    def __init__(self, scheduler: "TokenScheduler", chunks: list[Chunk], copies: list[tuple[int, int]]):
        self.scheduler = scheduler
        self.chunks = chunks
        self.copies = copies  # (source, copy) blocks to copy before the step runs (beams' shared partial blocks)

    # read as its chunks, in row order
    def __len__(self) -> int:
        return len(self.chunks)

    def __iter__(self) -> Iterator[Chunk]:
        return iter(self.chunks)

    def __getitem__(self, i: int) -> Chunk:
        return self.chunks[i]

    # -- draft reservations (speculation/draft.py) ------------------------------------------------------------

    @property
    def reserved(self) -> list[int]:
        """The rows holding blocks for a draft model's proposals."""
        return [i for i, c in enumerate(self.chunks) if c.reserved]

    def propose(self, i: int, proposals: list[int], draft: np.ndarray | None = None) -> None:
        """Row `i` carries `proposals` after its last token (within its reservation); `draft` is the
        draft's distributions they were drawn from (a sampling row's)."""
        chunk = self.chunks[i]
        assert len(proposals) <= chunk.reserved, (len(proposals), chunk.reserved)
        self.chunks[i] = Chunk(chunk.seq, chunk.token_ids + proposals, chunk.past_len, list(proposals), draft=draft)

    def withdraw(self, i: int) -> None:
        """Row `i` decodes without proposals: the blocks reserved for them go back."""
        chunk = self.chunks[i]
        self.scheduler.blocks.trim(chunk.seq)
        self.chunks[i] = replace(chunk, reserved=0)

    # -- the runner's call ------------------------------------------------------------------------

    def row_steps(self) -> list[RowStep]:
        """The graph's rows: one logits row per chunk (the graph's minimum; a chunk that ends
        mid-prompt ignores it), and one more per proposal; each with its sequence's (or beam's) whole
        length, which a LongRoPE graph's table switch reads (longrope.py)."""
        return [RowStep(c.token_ids, c.past_len, c.block_ids, 1 + len(c.proposals),
                        (c.seq if c.row is None else c.row).num_tokens) for c in self.chunks]

    @property
    def num_decode_rows(self) -> int:
        return sum(c.seq.status is Status.decoding for c in self.chunks)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    # -- the results --------------------------------------------------------------------------------

    def update_from_output(self, logits: np.ndarray, core: "EngineCore", sampled: dict[str, list[int]]) -> None:
        """Take the step's `logits` back: every sampling row gets its token(s) (through `core`,
        into `sampled`) and every chunk is committed."""
        chunks = self.chunks
        if any(c.seq.beam is not None for c in chunks):
            chunks, logits = self._beams(chunks, logits)
        if any(c.proposals for c in chunks):
            self._verify(chunks, logits, core, sampled)
            return
        for chunk in chunks:
            self.scheduler.computed(chunk)
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
            self.scheduler.computed(chunk)
            if chunk.samples:
                groups.setdefault(chunk.seq.request_id, (chunk.seq, []))[1].append(spans[i][-1])
        for seq, rows in groups.values():
            seq.status = Status.decoding
            beam.advance(seq, logits[rows], self.scheduler.blocks)
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
                self.scheduler.computed(chunk)
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
            self.scheduler.computed(chunk, accepted=accepted)
            if chunk.forced:
                self.scheduler.num_forced_tokens += accepted
            elif chunk.proposals:
                self.scheduler.speculator.count(len(chunk.proposals), len(tokens) - 1)
