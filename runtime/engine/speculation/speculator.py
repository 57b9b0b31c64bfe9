"""Speculative decoding inside the paged engine's steps: which decoding rows carry proposals, and
which of those proposals the target accepts.

A speculating row feeds the graph its last token plus its k proposals and gets k+1 rows of logits
back (RowStep.num_logits): row j is the target's next-token distribution after the first j
proposals. `verify` draws each row's token j from row j exactly as the non-speculative sampler
would at that point (sampling.py's `sample_rows`, with proposals 1..j counted as output for the
penalties and min_tokens), and keeps the proposals up to the first one the target did not draw,
then the target's token there: a correction, or a bonus token when all k were accepted.

This is the rejection-sampling rule of Leviathan et al. 2023 / Chen et al. 2023 for a draft whose
distribution q is a point mass on its proposal x (prompt lookup): accept x with probability
min(1, p(x)/q(x)) = p(x), else draw from norm(max(0, p - q)) = p without x, renormalized. Drawing
t ~ p and accepting iff t == x realizes exactly that (P(t = x) = p(x); given t != x, t follows p
without x), so the output follows the target's distribution exactly. Greedy rows are the special
case: the longest prefix the argmax agrees with, plus the argmax after it. Each kept token costs
its row one uniform, as the plain sampler's token does (the generator is wound back over the
draws of rejected positions), so a seeded request gives the same tokens with speculation on or
off. Written here: numpy has no rejection sampler, and vLLM's and TensorRT-LLM's run on GPUs.

A draft model (`speculative.method: draft`, draft.py) proposes from a distribution q that is not a
point mass when the request samples. Such a row goes through `reject`, the general rule: proposal
x_j is kept with probability min(1, p_j(x_j) / q_j(x_j)), where p_j and q_j are the target's and the
draft's distributions after the request's own processing (sampling.py's `distributions`:
penalties, temperature, top-k/top-p/min-p, with proposals 1..j-1 counted as output); the first
rejected one is replaced by a draw from norm(max(0, p_j - q_j)), and when all k are kept a bonus
token is drawn from p_{k+1}. Each kept token then follows p exactly (Leviathan et al. 2023,
theorem 1). Such rows draw from the request's generator too (one uniform per tested proposal, one
per drawn token), so a seeded request repeats itself, but its tokens differ from a run without
speculation (the draws fall differently); greedy rows are the argmax rule above with either method.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from llmc.runtime.engine import longrope
from llmc.runtime.engine.speculation.ngram import NgramProposer
from llmc.runtime.decoding.draw import Uniforms
from llmc.runtime.decoding.grammar import allowed, apply_bitmask
from llmc.runtime.decoding.sampling import distributions, draw_from, sample_rows

if TYPE_CHECKING:
    from llmc.runtime.manifest import SpeculativeConfig
    from llmc.runtime.engine.sequence import Sequence


@dataclass
class Speculator:
    """Proposals for up to `max_batch` decoding rows a step, each kept within the KV capacity, the
    request's max_tokens and the step's spare tokens. With prompt lookup the `proposer` gives them
    while the step is scheduled; with a draft model (`proposer` None) the scheduler only reserves
    blocks for `limit` proposals and draft.py fills them in, outside the scheduler's lock."""

    proposer: NgramProposer | None
    max_batch: int
    capacity: int  # max_seq_len: no proposal is written past it
    num_tokens: int  # k
    disable_batch_size: int = 1 << 30  # with more requests than this running or waiting, no row speculates
    longrope_switch: int | None = None  # a short sequence's proposals stay within it (longrope.py)
    num_draft_tokens: int = 0  # proposals verified, since start
    num_accepted_tokens: int = 0  # proposals the target accepted, since start

    @classmethod
    def from_config(cls, config: "SpeculativeConfig", capacity: int,
                    longrope_switch: int | None = None) -> "Speculator":
        proposer = NgramProposer(config.num_tokens, config.min_n, config.max_n) if config.method == "ngram" else None
        # unset: a draft's k calls a step cost the same however few of the batch's rows speculate, so it
        # speculates only while every request may; prompt lookup's proposals cost only their tokens
        disable = config.disable_batch_size or (config.max_batch if proposer is None else 1 << 30)
        return cls(proposer, config.max_batch, capacity, config.num_tokens, disable, longrope_switch=longrope_switch)

    @property
    def drafts(self) -> bool:
        """Proposals come from a draft model (draft.py), after scheduling."""
        return self.proposer is None

    def limit(self, seq: "Sequence", spare: int) -> int:
        """How many proposals may follow `seq`'s last token (room(), at most k)."""
        return room(seq, min(self.num_tokens, spare), self.capacity, self.longrope_switch)

    def propose(self, seq: "Sequence", spare: int) -> list[int]:
        """Prompt-lookup proposals to follow `seq`'s last token, at most `spare`; [] to decode it normally."""
        limit = self.limit(seq, spare)
        if limit < 1:
            return []
        tokens = np.concatenate([seq.prompt_array(), np.asarray(seq.output_ids, dtype=np.int64)])
        return self.proposer.propose(tokens, limit)

    def count(self, proposed: int, accepted: int) -> None:
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted


def room(seq: "Sequence", most: int, capacity: int, longrope_switch: int | None = None) -> int:
    """How many tokens to verify (proposals, or forced tokens) may follow `seq`'s last token in one
    step, at most `most`: positions num_tokens-1 .. num_tokens-1+n are written, so stay below
    `capacity`; the n+1 tokens kept at most stay within max_tokens; a LongRoPE sequence short of the
    switch verifies no position past it (longrope.py)."""
    below_switch = longrope.proposal_room(longrope_switch, seq.num_tokens)
    return max(0, min(most, capacity - seq.num_tokens, seq.params.max_tokens - len(seq.output_ids) - 1,
                      most if below_switch is None else below_switch))


def reject(p: np.ndarray, q: np.ndarray, proposals: list[int], rng: np.random.Generator) -> list[int]:
    """One row's tokens by the rejection rule: `proposals` (k tokens drawn from q's rows [k, V]),
    checked against the target's p [k+1, V]; the kept prefix, then a correction or the bonus token.
    `u * q < p` is `u < p / q` without the division (a proposal q gave no mass is kept iff p does)."""
    for j, x in enumerate(proposals):
        if rng.random() * q[j, x] < p[j, x]:
            continue
        residual = np.maximum(p[j] - q[j], 0.0)
        total = residual.sum()
        # p == q up to rounding leaves no residual mass (and then rejection had probability ~0): draw from p
        return proposals[:j] + [draw_from(residual / total if total > 0 else p[j], rng)]
    return proposals + [draw_from(p[len(proposals)], rng)]


def logit_rows(proposals: list[list[int]]) -> list[np.ndarray]:
    """Where each row's logits are in a step's: row i has 1 + len(proposals[i]) of them
    (RowStep.num_logits), after its last token and after each proposal, rows in order."""
    ends = np.cumsum([1 + len(props) for props in proposals])
    return [np.arange(end - 1 - len(props), end) for end, props in zip(ends, proposals)]


def verify(logits: np.ndarray, seqs: list["Sequence"], proposals: list[list[int]],
           drafts: list[np.ndarray | None] | None = None, end_ids: tuple[int, ...] = ()) -> list[list[int]]:
    """Each sequence's tokens this step: the proposals the target accepted, then its own token.

    `logits` holds 1 + len(proposals[i]) rows per sequence, in order: the rows after its last token
    and after each proposal. A sequence without proposals gets the one token the plain sampler gives.
    `drafts[i]`, when given, is the draft's q [k, V] the proposals were drawn from: a sampling row
    with one goes through `reject`; every other row through the point-mass rule. A guided row's
    proposals are tokens its grammar takes (prompt lookup's valid prefix, forced tokens, a draft's
    draws under the mask), and each of its rows is drawn under the mask of the grammar after the
    proposals before it (`end_ids`: the model's): a greedy one keeps exactly the tokens it would
    without speculation, and a draft's sampling row compares p and q both under the mask."""
    drafts = drafts if drafts is not None else [None] * len(seqs)
    spans = logit_rows(proposals)
    masks = {i: seq.guide.bitmasks_along(props, seq.params.end_ids, end_ids, logits.shape[1])
             for i, (seq, props) in enumerate(zip(seqs, proposals)) if seq.guide is not None}
    general = [i for i, (seq, props, q) in enumerate(zip(seqs, proposals, drafts))
               if q is not None and props and not seq.params.is_greedy]
    kept: list[list[int] | None] = [None] * len(seqs)
    if general:
        rows, at, masked = np.concatenate([spans[i] for i in general]), 0, []
        for i in general:
            masked += [at + j for j in range(len(spans[i]))] if i in masks else []
            at += len(spans[i])
        view = apply_bitmask(logits[rows], masked, np.concatenate([masks[i] for i in general if i in masks])) \
            if masked else logits[rows]
        p = distributions(view, *_row_inputs([seqs[i] for i in general], [proposals[i] for i in general]))
        at = 0
        for i in general:
            n = len(proposals[i]) + 1
            kept[i] = reject(p[at:at + n], drafts[i], proposals[i], seqs[i].rng)
            at += n
    plain = [i for i in range(len(seqs)) if kept[i] is None]
    if plain:
        rows = np.concatenate([spans[i] for i in plain])
        for i, tokens in zip(plain, _point_mass(logits[rows], [seqs[i] for i in plain], [proposals[i] for i in plain],
                                                [masks.get(i) for i in plain])):
            kept[i] = tokens
    return kept


def _row_inputs(seqs: list["Sequence"], proposals: list[list[int]]) -> tuple[list, list, list]:
    """sample_rows' per-row params, prompts and outputs for each sequence's 1 + k rows: row j counts
    proposals 1..j as output (penalties, min_tokens)."""
    params, prompts, outputs = [], [], []
    for seq, props in zip(seqs, proposals):
        for j in range(len(props) + 1):
            params.append(seq.params)
            prompts.append(seq.prompt_array())
            outputs.append(seq.output_ids + props[:j] if j else seq.output_ids)
    return params, prompts, outputs


def _point_mass(logits: np.ndarray, seqs: list["Sequence"], proposals: list[list[int]],
                masks: list[np.ndarray | None]) -> list[list[int]]:
    """The rule for proposals from a point mass (prompt lookup, forced tokens, or any greedy row):
    draw each row's token as the plain sampler would (core.py), keep proposals while they equal the
    draws. A guided row's `masks` [k + 1, W] are its grammar's after each proposal: a row drawn first
    there draws unmasked and, where the grammar refuses that token, again under the mask, from two
    uniforms a token as there; the other guided rows draw under the mask."""
    params, prompts, outputs = _row_inputs(seqs, proposals)
    spans = logit_rows(proposals)
    rngs, rewinds, redraws = [], [], {}
    for i, (seq, props) in enumerate(zip(seqs, proposals)):
        n, hot = len(props) + 1, not seq.params.is_greedy
        twice = hot and masks[i] is not None and seq.params.draws_first
        rewinds.append(seq.rng.bit_generator.state if hot and (props or twice) else None)
        if twice:  # an unmasked draw and a redraw's uniform for each row, as core.py takes them
            u = seq.rng.random(2 * n)
            rngs.extend([Uniforms(u[0::2])] * n)
            redraws[i] = u[1::2]
        else:
            rngs.extend([seq.rng] * n)  # sample_rows draws the rows' uniforms in row order
    first = [i for i, m in enumerate(masks) if m is not None and seqs[i].params.draws_first]
    upfront = [i for i, m in enumerate(masks) if m is not None and i not in first]
    guided = (np.concatenate([spans[i] for i in upfront]), np.concatenate([masks[i] for i in upfront])) \
        if upfront else None
    drawn = sample_rows(logits, params, prompts, outputs, rngs, guided)
    refused = [(i, j) for i in first for j, r in enumerate(spans[i]) if not allowed(masks[i][j], int(drawn[r]))]
    if refused:
        rows = [int(spans[i][j]) for i, j in refused]
        drawn[rows] = sample_rows(logits[rows], [params[r] for r in rows], [prompts[r] for r in rows],
                                  [outputs[r] for r in rows],
                                  [Uniforms([redraws[i][j]]) if i in redraws else seqs[i].rng for i, j in refused],
                                  (list(range(len(rows))), np.stack([masks[i][j] for i, j in refused])))
    kept = []
    for i, (seq, props, state) in enumerate(zip(seqs, proposals, rewinds)):
        row = drawn[spans[i]].tolist()
        accepted = next((j for j, (x, t) in enumerate(zip(props, row)) if x != t), len(props))
        kept.append(row[:accepted + 1])
        if state is not None:  # consume only the kept tokens' uniforms, as the plain sampler would
            seq.rng.bit_generator.state = state
            seq.rng.random((2 if i in redraws else 1) * (accepted + 1))
    return kept
