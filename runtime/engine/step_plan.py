"""One paged step's work list, held by one object from scheduling until what the graph wrote is
committed (the shape of vLLM v1's SchedulerOutput -> execute_model -> update_from_output):

    TokenScheduler.schedule() -> StepPlan: a chunk per row, the copy-on-write block copies, the
        rows with blocks reserved for a draft model's proposals
    DraftProposer.fill(plan) -> plan.propose(i, ...) / plan.withdraw(i) on the reserved rows
    runner.copy_blocks(plan.copies); runner.step(plan.row_steps()) -> logits
    TokenScheduler.update_from_output(plan, logits, core, sampled) -> beam groups advance (beam.py),
        proposals are verified (speculation/speculator.py), the other sampling rows sample; each chunk is
        committed: the scheduler that made the plan applies its output, as vLLM's does

Only the plan changes its chunks; the draft proposer and the engine go through its methods.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np

from llmc.runtime.engine.beam import BeamRow
from llmc.runtime.engine.sequence import Sequence, Status
from llmc.runtime.runners.paged import RowStep

if TYPE_CHECKING:
    from llmc.runtime.engine.block_manager import BlockManager


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
    def __init__(self, blocks: "BlockManager", chunks: list[Chunk], copies: list[tuple[int, int]]):
        self.blocks = blocks  # where a withdrawn reservation's blocks go back
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
        self.blocks.trim(chunk.seq)
        self.chunks[i] = replace(chunk, reserved=0)

    # -- the runner's call ------------------------------------------------------------------------

    def row_steps(self) -> list[RowStep]:
        """The graph's rows: one logits row per chunk (the graph's minimum; a chunk that ends
        mid-prompt ignores it), and one more per proposal; each with its sequence's (or beam's) whole
        length, which a LongRoPE graph's table switch reads (longrope.py), and its sequence's LoRA adapter."""
        return [RowStep(c.token_ids, c.past_len, c.block_ids, 1 + len(c.proposals),
                        (c.seq if c.row is None else c.row).num_tokens, c.seq.lora) for c in self.chunks]

    @property
    def num_decode_rows(self) -> int:
        return sum(c.seq.status is Status.decoding for c in self.chunks)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)
