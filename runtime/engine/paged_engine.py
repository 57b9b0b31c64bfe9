"""The engine over the paged KV cache: every step is one call of the graph carrying every row.

    step() = cancel -> schedule (token_scheduler.py: every decoding row, then prompt chunks up to
             `max_num_tokens`) -> one runner call -> sample the rows that reached their last token
             -> stream -> release the blocks of finished sequences

Requests, cancellation and streaming are LLMEngine's (engine.py); what differs is where KV lives
(blocks from block_manager.py instead of a slot per request) and that a step mixes prefill and
decode, so a long prompt no longer stalls the decoding rows. The rows that reached their last token
are sampled together, in one vectorized pass over their logits (sampling.py).

With `speculative` (the manifest's SpeculativeConfig) up to `max_batch` decoding rows a step also
carry proposed tokens (prompt lookup, ngram.py; or a draft model's, draft.py: its k batched calls
run after scheduling, before the target's); the same call verifies them and the rows keep what
the target accepts plus one token of its own (speculative.py), so such a row may gain several
tokens a step. Greedy outputs are the tokens the rows would get without speculation; sampled ones
follow the same distribution (and with prompt lookup are the same tokens for a seeded request).

A request with `beam_width` W > 1 (up to `max_beam_width`, serving.max_beam_width) runs beam
search (runtime/engine/beam.py): its prompt prefills as one row, then its W beams decode as W rows of
every step, sharing their blocks copy-on-write; its beams come out once, when it finishes.

With `itl_ratio` (serving.itl_ratio) a step's prompt tokens are also capped so the step stays
within that many decode steps of its rows, by a cost model fitted to the steps run (step_cost.py):
on a CPU a prompt token costs compute, and a fixed budget that suits 16 decode rows stretches a
4-row step several times over.
"""

from __future__ import annotations

import time

import numpy as np

from llmc.runtime.engine import beam
from llmc.runtime.engine.block_manager import BlockManager
from llmc.runtime.engine.draft import DraftProposer
from llmc.runtime.engine.slot_engine import CacheState, LLMEngine, StepOutput
from llmc.runtime.manifest import SpeculativeConfig
from llmc.runtime.runners.paged_batch import RowStep
from llmc.runtime.runners.paged import PagedRunner
from llmc.runtime.decoding.sampling import SamplingParams
from llmc.runtime.engine.sequence import FinishReason, Sequence, Status
from llmc.runtime.engine.speculative import Speculator, logit_rows, verify
from llmc.runtime.engine.step_cost import StepCost
from llmc.runtime.engine.token_scheduler import Chunk, TokenScheduler


class PagedEngine(LLMEngine):
    def __init__(self, runner: PagedRunner, tokenizer=None, *, end_ids: tuple[int, ...] = (), max_rows: int,
                 max_seq_len: int, max_num_tokens: int, max_queue_size: int = 256, prefix_caching: bool = True,
                 itl_ratio: float | None = None, speculative: SpeculativeConfig | None = None,
                 draft: PagedRunner | None = None, max_beam_width: int = 1):
        if not 1 <= max_beam_width <= max_rows:
            raise ValueError(f"max_beam_width ({max_beam_width}) must be between 1 and max_rows ({max_rows}): a beam "
                             f"request's beams are rows of one step")
        self.max_beam_width = max_beam_width
        self.blocks = BlockManager(runner.num_blocks, runner.block_size, prefix_caching)
        # itl_ratio: cap a step's prompt tokens so it stays within that many decode steps (step_cost.py)
        self.cost = StepCost(itl_ratio) if itl_ratio else None
        self.speculator = Speculator.from_config(speculative, max_seq_len) if speculative else None
        if (draft is not None) != (speculative is not None and speculative.method == "draft"):
            raise ValueError("a draft runner goes with speculative.method: draft, and that method needs one")
        if draft is not None and (draft.num_blocks, draft.block_size) != (runner.num_blocks, runner.block_size):
            raise ValueError(f"the draft's pools ({draft.num_blocks} blocks of {draft.block_size}) must match the "
                             f"target's ({runner.num_blocks} of {runner.block_size}): they share its block tables")
        self.drafter = DraftProposer(draft, runner.vocab_size) if draft is not None else None
        self._setup(runner, tokenizer, end_ids, max_seq_len, max_num_tokens,
                    TokenScheduler(self.blocks, max_rows=max_rows, max_num_tokens=max_num_tokens,
                                   max_queue_size=max_queue_size, speculator=self.speculator))

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams, **kwargs) -> Sequence:
        """LLMEngine's checks, and that the prompt fits the KV pool at all (a full pool only queues it)."""
        # a beam request's first step: its prompt's blocks, and at most one more block per beam
        needed = self.blocks.blocks_for(len(prompt_ids) + 1) if params.beam_width == 1 else \
            self.blocks.blocks_for(len(prompt_ids)) + params.beam_width
        if needed > self.blocks.num_blocks:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens; with room for one more it needs {needed} KV "
                             f"blocks and the whole pool has {self.blocks.num_blocks} (limits.kv_cache_tokens)")
        return super().add_request(request_id, prompt_ids, params, **kwargs)

    def _prepare(self, seq: Sequence) -> None:
        if seq.params.beam_width > 1:
            beam.start(seq, self.capacity)

    def close(self) -> None:
        super().close()
        if self.drafter is not None:
            self.drafter.close()

    def cache_state(self) -> CacheState:
        b, s, spec = self.blocks, self.scheduler, self.speculator
        return CacheState(s.num_running, s.num_waiting, b.num_used / b.num_blocks,
                          {"used": b.num_used, "free": b.num_free, "cached": b.num_cached},
                          b.prefix_queries, b.prefix_hits, s.num_preemptions,
                          spec.num_draft_tokens if spec else 0, spec.num_accepted_tokens if spec else 0)

    def step(self) -> list[StepOutput]:
        with self._lock:
            finished = self._apply_cancellations()
            for seq in self.scheduler.running:
                if not seq.is_finished and seq.num_tokens > self.capacity:
                    seq.finish(FinishReason.length)  # the next token would pass max_seq_len
            chunks = [c for c in self.scheduler.schedule(self.cost.prompt_cap if self.cost else None)
                      if not c.seq.is_finished]
        if self.drafter is not None:
            chunks = self.drafter.fill(chunks, self.blocks)
        sampled: dict[str, list[int]] = {}
        if chunks:
            self._run(chunks, sampled)
        return self._outputs(list(self.scheduler.running), finished, sampled)

    def _run(self, chunks: list[Chunk], sampled: dict[str, list[int]]) -> None:
        # one logits row per chunk (the graph's minimum): a chunk that ends mid-prompt ignores its row
        decoding = sum(c.seq.status is Status.decoding for c in chunks)
        if self.scheduler.copies:  # copy-on-write: beams' shared partial blocks, before the step writes them
            self.runner.copy_blocks(self.scheduler.copies)
        start = time.perf_counter()
        logits = self.runner.step([RowStep(c.token_ids, c.past_len, c.block_ids, 1 + len(c.proposals))
                                   for c in chunks])
        if self.cost is not None:  # proposals cost what prompt tokens do: compute beside the weights' read
            self.cost.observe(decoding, sum(len(c.token_ids) for c in chunks) - decoding, time.perf_counter() - start)
        if any(c.seq.beam is not None for c in chunks):
            chunks, logits = self._beams(chunks, logits)
        if any(c.proposals for c in chunks):
            self._verify(chunks, logits, sampled)
            return
        for chunk in chunks:
            self.scheduler.computed(chunk)
        rows = [i for i, c in enumerate(chunks) if c.samples]
        if rows:
            for i in rows:
                chunks[i].seq.status = Status.decoding
            self._sample([chunks[i].seq for i in rows], logits[rows], sampled)

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
            beam.advance(seq, logits[rows], self.blocks)
        return others, logits[other_rows]

    def _verify(self, chunks: list[Chunk], logits: np.ndarray, sampled: dict[str, list[int]]) -> None:
        """A step with proposals: each sampling row keeps the tokens verify() gives it; a row's
        length (and its committed KV) advances over its accepted proposals only."""
        spans = logit_rows([c.proposals for c in chunks])
        rows = [i for i, c in enumerate(chunks) if c.samples]
        for chunk in chunks:
            if not chunk.samples:
                self.scheduler.computed(chunk)
        picked = np.concatenate([spans[i] for i in rows])
        kept = verify(logits[picked], [chunks[i].seq for i in rows], [chunks[i].proposals for i in rows],
                      [chunks[i].draft for i in rows])
        at = 0
        for i, tokens in zip(rows, kept):
            chunk = chunks[i]
            chunk.seq.status = Status.decoding
            emitted = self._emit_all(chunk.seq, logits[picked[at:at + len(tokens)]], tokens, sampled)
            at += 1 + len(chunk.proposals)
            self.scheduler.computed(chunk, accepted=min(len(tokens) - 1, emitted))
            if chunk.proposals:
                self.speculator.count(len(chunk.proposals), len(tokens) - 1)

    def _emit_all(self, seq: Sequence, logits: np.ndarray, tokens: list[int], sampled: dict[str, list[int]]) -> int:
        """Append `tokens` (row j of `logits` drew token j) until `seq` finishes; how many it took."""
        for j, token in enumerate(tokens):
            if seq.is_finished:
                return j
            self._emit(seq, logits[j], token, sampled)
        return len(tokens)
