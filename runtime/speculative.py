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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from llmc.runtime.ngram import NgramProposer
from llmc.runtime.sampling import sample_rows

if TYPE_CHECKING:
    from llmc.runtime.manifest import SpeculativeConfig
    from llmc.runtime.sequence import Sequence


@dataclass
class Speculator:
    """Proposals for up to `max_batch` decoding rows a step, each kept within the KV capacity, the
    request's max_tokens and the step's spare tokens."""

    proposer: NgramProposer
    max_batch: int
    capacity: int  # max_seq_len: no proposal is written past it
    num_draft_tokens: int = 0  # proposals verified, since start
    num_accepted_tokens: int = 0  # proposals the target accepted, since start

    @classmethod
    def from_config(cls, config: "SpeculativeConfig", capacity: int) -> "Speculator":
        return cls(NgramProposer(config.num_tokens, config.min_n, config.max_n), config.max_batch, capacity)

    def propose(self, seq: "Sequence", spare: int) -> list[int]:
        """Proposals to follow `seq`'s last token, at most `spare`; [] to decode it normally."""
        # positions num_tokens-1 .. num_tokens-1+k are written: stay below capacity; the k+1 tokens
        # kept at most stay within max_tokens
        limit = min(spare, self.capacity - seq.num_tokens, seq.params.max_tokens - len(seq.output_ids) - 1)
        if limit < 1:
            return []
        tokens = np.concatenate([seq.prompt_array(), np.asarray(seq.output_ids, dtype=np.int64)])
        return self.proposer.propose(tokens, limit)

    def count(self, proposed: int, accepted: int) -> None:
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted


def verify(logits: np.ndarray, seqs: list["Sequence"], proposals: list[list[int]]) -> list[list[int]]:
    """Each sequence's tokens this step: the proposals the target accepted, then its own token.

    `logits` holds 1 + len(proposals[i]) rows per sequence, in order: the rows after its last token
    and after each proposal. A sequence without proposals gets the one token the plain sampler gives."""
    params, prompts, outputs, rngs, states = [], [], [], [], []
    for seq, props in zip(seqs, proposals):
        states.append(seq.rng.bit_generator.state if props and not seq.params.is_greedy else None)
        for j in range(len(props) + 1):
            params.append(seq.params)
            prompts.append(seq.prompt_array())
            outputs.append(seq.output_ids + props[:j] if j else seq.output_ids)
            rngs.append(seq.rng)  # sample_rows draws the rows' uniforms in row order: position j's is the j-th
    drawn = sample_rows(logits, params, prompts, outputs, rngs).tolist()
    kept, at = [], 0
    for seq, props, state in zip(seqs, proposals, states):
        row = drawn[at:at + len(props) + 1]
        at += len(props) + 1
        accepted = next((j for j, (x, t) in enumerate(zip(props, row)) if x != t), len(props))
        kept.append(row[:accepted + 1])
        if state is not None:  # consume only the kept tokens' uniforms, as the plain sampler would
            seq.rng.bit_generator.state = state
            seq.rng.random(accepted + 1)
    return kept
