"""Beam search inside the paged engine's in-flight batching: a request with `beam_width` W > 1 is
one sequence in the scheduler (the group) whose W beams are W rows of the same steps.

    admit -> prefill the prompt once (one row) -> its logits pick the first W beams: the rows fork
    from the prompt's blocks -> every step all W rows decode together -> their logits pick the next
    W beams (each a row of a parent plus one token) -> ... -> the search is done: the W best
    finished hypotheses are the result, sent once at the end

The search is transformers' `_beam_search` (generation/utils.py, 5.x) for one request, so its beams
equal `generate(num_beams=W, num_return_sequences=W, do_sample=False, length_penalty=...,
early_stopping=...)` token for token:
- a step scores every (beam, token) as the beam's running score (the sum of its tokens'
  log-probabilities, float32) plus the token's log_softmax; the first step sees the prompt as W
  copies scored 0, -1e9, -1e9, ... (so only the first counts, as transformers initializes them);
- it keeps the top K = max(2, 1 + number of end ids) * W candidates; of them, the ones that end
  (an end id, or max_tokens reached) and rank among the first W become finished hypotheses scored
  sum / (generated tokens, the end id included) ** length_penalty; the W best hypotheses are kept;
- the W best candidates that do not end are the next step's beams;
- the search is done when every candidate ends (max_tokens), when early_stopping is True and W
  hypotheses are finished, or when no running beam can beat the worst of W finished ones: its
  best score divided by the current generated length ** length_penalty (the maximum length
  instead with early_stopping "never" and length_penalty > 0) is not above it;
- min_tokens masks the end ids' log-probabilities to -inf while fewer tokens are generated.
The result is the W hypotheses, best score first. A search ended from outside (cancelled, or alone
in a KV pool it outgrew) ranks its running beams as hypotheses of their current length too.
The serving wing lays the result out as the response's tensors (runtime/serving/responses.py).

Written here by hand: transformers' search runs on torch tensors over a padded batch of requests
with a reorderable cache; here one request's beams are numpy rows inside a step shared with other
requests, and a beam's KV is its parent's blocks shared by reference count, with copy-on-write of
the partial last block (block_manager.py) instead of a reordered cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from llmc.runtime.decoding.tokenizer import IncrementalDetokenizer
from llmc.runtime.engine.sequence import FinishReason

if TYPE_CHECKING:
    from llmc.runtime.engine.block_manager import BlockManager
    from llmc.runtime.decoding.sampling import SamplingParams
    from llmc.runtime.engine.sequence import Sequence

_NEG = np.float32(-1.0e9)  # transformers' "not a candidate" score


@dataclass
class BeamRow:
    """A live beam: its tokens (prompt and generated), the blocks holding their KV, and its running
    score (the sum of its generated tokens' log-probabilities). The block manager reads it as it
    reads a sequence (block_manager.Blocked)."""

    token_ids: list[int]
    block_ids: list[int]
    num_cached: int
    score: np.float32
    long_rope: bool = False  # its KV were computed with LongRoPE's long factors (its request's, longrope.py)
    adapter_key: bytes | None = None  # its request's LoRA adapter's prefix-cache key (prefix_keys.py)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def all_token_ids(self) -> list[int]:
        return self.token_ids


@dataclass(frozen=True)
class Beam:
    """One returned beam: its generated ids (a final end id included), their summed log-probability,
    the score it was ranked by (that sum / length ** length_penalty) and its text."""

    token_ids: list[int]
    cum_log_prob: float
    score: float
    ended: bool  # ended with an end id (else it reached max_tokens, or the search was cut short)
    text: str = ""


@dataclass
class BeamSearch:
    """One request's search: the live rows, the finished hypotheses, whether it is done."""

    prompt_ids: list[int]
    params: "SamplingParams"
    max_new_tokens: int  # max_tokens, within the KV capacity
    rows: list[BeamRow] = field(default_factory=list)
    hyps: list[Beam] = field(default_factory=list)
    done: bool = False

    @property
    def width(self) -> int:
        return self.params.beam_width

    def restart(self) -> None:
        """Back to the prompt (the group was preempted: it recomputes, and ends the same way)."""
        self.rows, self.hyps, self.done = [], [], False

    def step(self, logits: np.ndarray, parents: list[BeamRow], blocks: "BlockManager") -> None:
        """One token more: `logits` [len(parents), V] are the parents' next-token logits (one row,
        the prompt's, on the first step). The next beams fork from their parents' blocks; the
        parents' own hold on them is released."""
        width, end_ids, prompt_len = self.width, list(self.params.end_ids), len(self.prompt_ids)
        scores = np.array([p.score for p in parents], dtype=np.float32)
        if len(parents) == 1:  # the prompt: W copies, all but the first out of the running
            parents, logits = parents * width, np.repeat(logits, width, axis=0)
            scores = np.array([0.0] + [_NEG] * (width - 1), dtype=np.float32)
        log_probs = _log_softmax(logits)
        generated = len(parents[0].token_ids) - prompt_len
        if generated < self.params.min_tokens and end_ids:
            log_probs[:, end_ids] = -np.inf
        log_probs += scores[:, None]  # in place: W x vocabulary floats are most of the search's own time
        total = log_probs.reshape(-1)
        k = min(max(2, 1 + len(end_ids)) * width, total.size)
        kth = np.partition(total, total.size - k)[total.size - k]  # the k-th best score
        top = np.flatnonzero(total >= kth)  # k of them (more on a tie at the k-th)
        top = top[np.lexsort((top, -total[top]))][:k]  # best first; a tie goes to the lower (beam, token)
        vocab = log_probs.shape[1]
        values, parent, token = total[top], top // vocab, top % vocab
        length = generated + 1
        ends = np.fromiter((t in self.params.end_ids for t in token.tolist()), bool, len(token)) | \
            (length >= self.max_new_tokens)
        running = values + ends.astype(np.float32) * _NEG
        keep = np.argsort(-running, kind="stable")[:width]
        self._finish_hypotheses(values[:width], parent[:width], token[:width], ends[:width], parents, length)
        self.done = self._is_done(running[keep[0]], length) or bool(ends.all())
        rows = [] if self.done else [
            BeamRow(parents[parent[i]].token_ids + [int(token[i])], blocks.fork(parents[parent[i]].block_ids),
                    parents[parent[i]].num_tokens, running[i], parents[parent[i]].long_rope,
                    parents[parent[i]].adapter_key) for i in keep]
        for row in {id(p): p for p in parents}.values():  # forks first: a shared block never drops to 0
            blocks.free(row)
        self.rows = rows

    def _finish_hypotheses(self, values, parent, token, ends, parents: list[BeamRow], length: int) -> None:
        """Candidates among the first W that end become hypotheses; the W best are kept."""
        divisor = np.float32(length ** self.params.length_penalty)
        new = [Beam(parents[p].token_ids[len(self.prompt_ids):] + [int(t)], float(v), float(np.float32(v) / divisor),
                    int(t) in self.params.end_ids)
               for v, p, t, e in zip(values, parent, token, ends) if e]
        if new:
            self.hyps = sorted(self.hyps + new, key=lambda h: -h.score)[:self.width]

    def _is_done(self, best_running: np.float32, length: int) -> bool:
        """transformers' stopping rule, after a step that generated `length` tokens."""
        lp, early = self.params.length_penalty, self.params.early_stopping
        if len(self.hyps) < self.width:
            return False  # an open slot: any running beam improves on it
        if early is True:
            return True
        best_length = self.max_new_tokens if early == "never" and lp > 0.0 else length
        best_possible = np.float32(best_running) / np.float32(best_length ** lp)
        return not best_possible > min(h.score for h in self.hyps)

    def results(self, tokenizer=None) -> list[Beam]:
        """The W best hypotheses, best first (with the running beams if the search was cut short),
        with their text when a tokenizer is given (a final end id is not text)."""
        hyps = self.hyps
        if not self.done and self.rows:
            prompt_len, lp = len(self.prompt_ids), self.params.length_penalty
            cut = [Beam(r.token_ids[prompt_len:], float(r.score),
                        float(r.score / np.float32((r.num_tokens - prompt_len) ** lp)), False) for r in self.rows]
            hyps = sorted(hyps + cut, key=lambda h: -h.score)[:self.width]
        if tokenizer is None:
            return list(hyps)
        return [Beam(h.token_ids, h.cum_log_prob, h.score, h.ended, self._text(tokenizer, h)) for h in hyps]

    def _text(self, tokenizer, beam: Beam) -> str:
        ids = beam.token_ids[:-1] if beam.ended else beam.token_ids
        detok = IncrementalDetokenizer(tokenizer, self.prompt_ids)
        return "".join(detok.push(t) for t in ids) + detok.finish()


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    """float32 log_softmax over the last axis, as torch computes it (shifted by the row's maximum)."""
    x = logits.astype(np.float32, copy=True)
    x -= x.max(axis=1, keepdims=True)
    x -= np.log(np.exp(x).sum(axis=1, keepdims=True, dtype=np.float32))
    return x


def start(seq: "Sequence", capacity: int) -> None:
    """Give a beam request its search (before it is queued): max_tokens within the KV capacity
    (the last token needs no KV, as a plain request's: capacity + 1 tokens in all)."""
    max_new = min(seq.params.max_tokens, capacity + 1 - len(seq.prompt_ids))
    seq.beam = BeamSearch(list(seq.prompt_ids), seq.params, max_new)


def advance(seq: "Sequence", logits: np.ndarray, blocks: "BlockManager") -> None:
    """After a step: the group's rows (its prompt, the first time) gave `logits`; pick the next beams,
    and finish the request when the search is done (`stop` if its best beam ended with an end id)."""
    search = seq.beam
    parents = search.rows
    if not parents:  # the prompt's blocks pass to the first beams
        parents = [BeamRow(list(seq.prompt_ids), seq.block_ids, seq.num_cached, np.float32(0.0), seq.long_rope,
                           seq.adapter_key)]
        seq.block_ids = []
    search.step(logits, parents, blocks)
    if search.done:
        seq.finish(FinishReason.stop if search.hyps[0].ended else FinishReason.length)


def free(seq: "Sequence", blocks: "BlockManager") -> None:
    """Give back the blocks of every live beam of `seq` (they keep their tokens, for results)."""
    for row in seq.beam.rows:
        blocks.free(row)

