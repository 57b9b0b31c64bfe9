"""Draft-model proposals (`speculative.method: draft`): a smaller paged graph (a separate checkpoint
with the target's tokenizer, or the target itself quantized) proposes k tokens a step for the rows
of the step plan that reserved blocks for them (step_plan.py), and the target verifies them in its
one call (speculative.py).

The draft has its own block pools (a PagedRunner) of the target's num_blocks and block_size, and
reads and writes them through the target's block tables: block b of a sequence holds its target KV
in the target's pools and its draft KV in the draft's, so the block manager, preemption and
rollback serve both. Memory: the draft's pools cost num_blocks x block_size x its layers x 2 x
KV heads x head_dim x its KV element size (`DraftProposer.nbytes`; for a self-draft exactly the
target's pool bytes again).

Each sequence records how many of its tokens have draft KV (`Sequence.draft_cached`). The draft
catches up lazily: a speculating row's first draft call feeds every token from there to its last
(its whole prompt the first time, and after that the last token, plus the bonus token's
predecessor when all k were accepted), within `max_num_tokens` tokens a call; a row whose
catch-up does not fit in one call advances part of the way and decodes normally this step. Then
k-1 more batched calls feed one proposal each. Rows beyond `max_batch` are not fed; they catch up
when they next speculate. After verification `draft_cached` is clamped to the target's
`num_cached`: a rejected proposal's draft KV, like its target KV, is past the sequence's length
and overwritten later. A prefix found in the prefix cache saves the target's prefill, not the
draft's: a new sequence starts at draft_cached 0 (whether an earlier sequence's draft wrote the
shared blocks in full is not tracked), and its draft rewrites the same values into them.

A LongRoPE draft (runtime/engine/longrope.py) is given each sequence's length as the target is; a
short sequence's proposals stop at the switch, and when the sequence recomputes its KV past it, so
does the draft (draft_cached 0).

The proposals are drawn from the draft's distributions after the request's processing
(sampling.py's `distributions`: penalties, temperature, top-k/top-p/min-p, earlier proposals
counted as output), with the request's own generator, so a seeded request repeats itself; a greedy
row proposes the draft's argmax. A sampling row's distributions travel with its chunk to the
rejection rule; a greedy row's are point masses and need none.

A guided row (structured output) proposes under its grammar's mask: the draft's logits are masked
by the grammar after the proposals so far (the matcher consumes each proposal as it is drawn and is
rolled back once the row's proposals are made), the row stops before an end id and after a proposal
that completes the grammar, and the target verifies each position under the same masks
(speculative.py), so a greedy guided row's output is the same with a draft as without.
"""

from __future__ import annotations

import numpy as np

from llmc.runtime.decoding.grammar import apply_bitmask, next_token_bitmask
from llmc.runtime.decoding.sampling import distributions, draw_from, penalize
from llmc.runtime.engine.step_plan import Chunk, StepPlan
from llmc.runtime.runners.paged import PagedRunner
from llmc.runtime.runners.paged import RowStep


class DraftProposer:
    def __init__(self, runner: PagedRunner, vocab_size: int, end_ids: tuple[int, ...] = ()):
        if runner.vocab_size != vocab_size:
            raise ValueError(f"the draft graph's vocabulary has {runner.vocab_size} ids and the target's {vocab_size}; "
                             "a draft must share the target's tokenizer and vocabulary")
        self.runner, self.end_ids = runner, tuple(end_ids)  # end_ids: the model's (a guided row's mask)

    @property
    def nbytes(self) -> int:
        """The draft's block pools."""
        return self.runner.nbytes

    def close(self) -> None:
        self.runner.close()

    def fill(self, plan: StepPlan) -> None:
        """The draft's proposals after each row of `plan` that reserved positions for them; a row the
        draft could not catch up this step decodes without, and its reserved blocks go back."""
        rows = plan.reserved
        if not rows:
            return
        ready, logits = self._catch_up([plan.chunks[i] for i in rows])
        for i, ok in zip(rows, ready):
            if not ok:
                plan.withdraw(i)
        live = [i for i, ok in zip(rows, ready) if ok]
        if not live:
            return
        seqs, limits = [plan.chunks[i].seq for i in live], [plan.chunks[i].reserved for i in live]
        proposals: list[list[int]] = [[] for _ in live]
        dists: list[list[np.ndarray]] = [[] for _ in live]
        for step in range(max(limits)):
            going = [r for r in range(len(live)) if limits[r] > step]
            if not going:  # every guided row stopped early
                break
            if step:  # feed each going row its last proposal, at the position after its last token + step - 1
                logits = self.runner.step([RowStep([proposals[r][-1]], seqs[r].num_tokens + step - 1,
                                                   seqs[r].block_ids, seq_len=seqs[r].num_tokens + step)
                                           for r in going])
            else:
                logits = logits[going]
            logits = self._masked(logits, [seqs[r] for r in going])
            greedy = [at for at, r in enumerate(going) if seqs[r].params.is_greedy]  # rows of `logits`
            hot = [at for at, r in enumerate(going) if not seqs[r].params.is_greedy]
            if greedy:  # a greedy row's q is a point mass on the penalized argmax: no array
                rows = [going[at] for at in greedy]
                picked = penalize(logits[greedy], *_inputs(seqs, proposals, rows)).argmax(axis=1)
                for r, token in zip(rows, picked.tolist()):
                    proposals[r].append(token)
            if hot:
                rows = [going[at] for at in hot]
                for r, dist in zip(rows, distributions(logits[hot], *_inputs(seqs, proposals, rows))):
                    proposals[r].append(draw_from(dist, seqs[r].rng))
                    dists[r].append(dist.astype(np.float32))
            for r in going:
                if seqs[r].guide is not None:
                    limits[r] = self._advance(seqs[r], proposals[r], dists[r], limits[r])
        for i, seq, props, d in zip(live, seqs, proposals, dists):
            seq.draft_cached = seq.num_tokens + len(props) - 1  # the last token and proposals 1..k-1
            if seq.guide is not None:
                seq.guide.rollback(len(props))  # advanced over its proposals while they were drawn
            if props:
                plan.propose(i, props, np.stack(d) if d else None)
            else:  # a guided row whose grammar could only end: it decodes without
                plan.withdraw(i)

    def _masked(self, logits: np.ndarray, seqs: list) -> np.ndarray:
        """`logits` with each guided row's masked by its grammar (advanced over its proposals so far), so
        a guided row proposes only what its grammar takes: its greedy draft's argmax, or a draw from q
        under the mask, which the target's verification compares with p under the same mask."""
        guided = [r for r, seq in enumerate(seqs) if seq.guide is not None]
        if not guided:
            return logits
        bitmask = next_token_bitmask([seqs[r].guide for r in guided], [seqs[r].params.end_ids for r in guided],
                                     self.end_ids, logits.shape[1])
        return apply_bitmask(logits, guided, bitmask)

    @staticmethod
    def _advance(seq, proposals: list[int], dists: list, limit: int) -> int:
        """A guided row's grammar over its newest proposal; the row's new limit: it stops before an end
        id (the target's own token decides the end) and after a proposal that completes the grammar."""
        token = proposals[-1]
        if token in seq.params.end_ids:
            proposals.pop()
            if dists:
                dists.pop()
            return len(proposals)
        seq.guide.consume(token)
        return len(proposals) if seq.guide.is_stopped else limit

    def _catch_up(self, chunks: list[Chunk]) -> tuple[list[bool], np.ndarray]:
        """One draft call feeding each row the tokens its draft KV lacks, up to its last, within the
        runner's `max_num_tokens`: (which rows reached their last token, those rows' logits in order)."""
        budget, steps, ready, fed_ready = self.runner.max_num_tokens, [], [], []
        for chunk in chunks:
            seq = chunk.seq
            pending = seq.all_token_ids()[seq.draft_cached:]
            take = pending[:budget]
            ready.append(bool(take) and len(take) == len(pending))
            if take:
                steps.append(RowStep(take, seq.draft_cached, seq.block_ids, seq_len=seq.num_tokens))
                fed_ready.append(ready[-1])
                seq.draft_cached += len(take)
                budget -= len(take)
        if not steps:
            return ready, np.empty((0, self.runner.vocab_size), np.float32)
        return ready, self.runner.step(steps)[np.asarray(fed_ready, dtype=bool)]


def _inputs(seqs, proposals: list[list[int]], rows: list[int]) -> tuple[list, list, list]:
    """sample_rows' params, prompts and outputs for `rows`, their proposals so far counted as output."""
    return ([seqs[r].params for r in rows], [seqs[r].prompt_array() for r in rows],
            [seqs[r].output_ids + proposals[r] for r in rows])
