"""Proposals a step's decode rows carry after their last tokens, added once every decode row has its blocks, so a
proposal never takes a block a row needs for its own token, nor preempts anyone:

- fast-forward (on by default): where a guided row's grammar forces the next tokens (a JSON schema's keys and
  punctuation: llguidance's fast-forward tokens, grammar.py), the row feeds them as proposals and the step verifies
  them under the grammar's mask at each position like prompt lookup's (speculator.py), so the row gains them and
  its own next token in one graph call instead of one call each. The verification makes them exact: a greedy
  row's tokens are those it samples without fast-forward, and every token, forced ones included, gets the log
  probabilities of its own logits row. `python -m llmc.bench structured` measured 1.1x the tokens/s at 16
  constrained streams and 1.4x at one (SmolLM2, a third of the tokens forced);
- speculation: prompt lookup's proposals (ngram.py), or blocks reserved for a draft model's (draft.py).
"""

from __future__ import annotations

from llmc.runtime.engine.block_manager import BlockManager
from llmc.runtime.engine.speculation.speculator import Speculator, room
from llmc.runtime.engine.step_plan import Chunk


def fast_forward(chunks: list[Chunk], blocks: BlockManager, max_num_tokens: int, capacity: int) -> None:
    """The tokens each guided decode row's grammar forces next (grammar.py's forced_tokens) after
    its last token, within the step's spare tokens and the free blocks: fed as proposals and
    verified under the grammar's masks like prompt lookup's (speculator.py), so the row takes
    them and its own next token in one step, each with the log probabilities of its logits row."""
    spare = max_num_tokens - len(chunks)
    for i, chunk in enumerate(chunks):
        seq = chunk.seq
        if spare < 1:
            break
        if seq.guide is None:
            continue
        forced = seq.guide.forced_tokens(room(seq, spare, capacity, blocks.longrope_switch), seq.params.end_ids)
        if forced and blocks.can_append(seq, len(forced)):
            blocks.append(seq, len(forced))
            chunks[i] = Chunk(seq, chunk.token_ids + forced, chunk.past_len, forced, forced=True)
            spare -= len(forced)


def speculate(chunks: list[Chunk], speculator: Speculator, blocks: BlockManager, max_num_tokens: int) -> None:
    """Proposals after the last token of at most `max_batch` decode rows (the oldest that have
    any), within the step's spare tokens and the free blocks. Run once every decode row has its
    blocks, so speculation never takes a block a row needs for its own token, nor preempts anyone."""
    spare, rows = max_num_tokens - sum(len(c.token_ids) for c in chunks), 0
    for i, chunk in enumerate(chunks):
        if spare < 1 or rows == speculator.max_batch:
            break
        if chunk.seq.beam is not None or chunk.forced:  # beams pick by score over W rows; forced tokens are in
            continue
        guide = chunk.seq.guide
        if speculator.drafts:  # blocks for the most the draft may propose; it fills them after scheduling
            # (a guided row's draft proposes under its grammar's mask, draft.py)
            limit = speculator.limit(chunk.seq, spare)
            if limit and blocks.can_append(chunk.seq, limit):
                blocks.append(chunk.seq, limit)
                chunks[i] = Chunk(chunk.seq, chunk.token_ids, chunk.past_len, reserved=limit)
                spare, rows = spare - limit, rows + 1
            continue
        proposals = speculator.propose(chunk.seq, spare)
        if proposals and guide is not None:  # only what its grammar takes (verified under its masks)
            proposals = proposals[:guide.valid_prefix(proposals, chunk.seq.params.end_ids)]
        if proposals and blocks.can_append(chunk.seq, len(proposals)):
            blocks.append(chunk.seq, len(proposals))
            chunks[i] = Chunk(chunk.seq, chunk.token_ids + proposals, chunk.past_len, proposals)
            spare, rows = spare - len(proposals), rows + 1
