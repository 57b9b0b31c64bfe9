"""The engine over the paged KV cache: every step is one call of the graph carrying every row.

    step() = cancel -> schedule (token_scheduler.py: every decoding row, then prompt chunks up to
             `max_num_tokens`; a StepPlan, step_plan.py) -> one runner call -> the plan takes the
             logits back: sample the rows that reached their last token -> stream -> release the
             blocks of finished sequences

Requests, cancellation and streaming are the EngineCore's (core.py), as in the slot engine
(slot_engine.py); what differs is where KV lives (blocks from block_manager.py instead of a slot
per request) and that a step mixes prefill and decode, so a long prompt no longer stalls the
decoding rows. The rows that reached their last token are sampled together, in one vectorized
pass over their logits (sampling.py).

With `speculative` (the manifest's SpeculativeConfig) up to `max_batch` decoding rows a step also
carry proposed tokens (prompt lookup, speculation/ngram.py; or a draft model's, speculation/draft.py: its k batched calls
fill the plan after scheduling, before the target's); the same call verifies them and the rows
keep what the target accepts plus one token of its own (speculation/speculator.py), so such a row may gain
several tokens a step. Greedy outputs are the tokens the rows would get without speculation; sampled ones
follow the same distribution (and with prompt lookup are the same tokens for a seeded request).
A guided row whose grammar forces its next tokens feeds them the same way, verified as proposals
(`fast_forward`, token_scheduler.py), with or without `speculative`.

With `lora` (lora_slots.py: the adapter store and lora.max_slots) a request may name a LoRA adapter: an unknown
name is refused before anything runs; the scheduler caps a step's distinct adapters, and each row carries its
sequence's adapter weights to the runner, which runs the LoRA graph for a step with any adapter token and the base
graph otherwise (runtime/runners/paged_lora.py).

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

from llmc.runtime.decoding.grammar import GuideMatcher
from llmc.runtime.decoding.sampling import SamplingParams
from llmc.runtime.engine import beam, longrope
from llmc.runtime.engine.block_manager import BlockManager
from llmc.runtime.engine.core import CacheState, EngineCore, StepOutput
from llmc.runtime.engine.lora_slots import LoraSlots
from llmc.runtime.engine.speculation.draft import DraftProposer
from llmc.runtime.engine.sequence import FinishReason, Sequence
from llmc.runtime.engine.speculation.speculator import Speculator
from llmc.runtime.engine.step_cost import StepCost
from llmc.runtime.engine.token_scheduler import TokenScheduler
from llmc.runtime.lora.store import UnknownAdapter
from llmc.runtime.manifest import SpeculativeConfig
from llmc.runtime.runners.paged import PagedRunner


class PagedEngine:
    def __init__(self, runner: PagedRunner, tokenizer=None, *, end_ids: tuple[int, ...] = (), max_rows: int,
                 max_seq_len: int, max_num_tokens: int, max_queue_size: int = 256, prefix_caching: bool = True,
                 itl_ratio: float | None = None, speculative: SpeculativeConfig | None = None,
                 draft: PagedRunner | None = None, max_beam_width: int = 1, fast_forward: bool = True,
                 lora: LoraSlots | None = None):
        if not 1 <= max_beam_width <= max_rows:
            raise ValueError(f"max_beam_width ({max_beam_width}) must be between 1 and max_rows ({max_rows}): a beam "
                             f"request's beams are rows of one step")
        if (draft is not None) != (speculative is not None and speculative.method == "draft"):
            raise ValueError("a draft runner goes with speculative.method: draft, and that method needs one")
        if draft is not None and (draft.num_blocks, draft.block_size) != (runner.num_blocks, runner.block_size):
            raise ValueError(f"the draft's pools ({draft.num_blocks} blocks of {draft.block_size}) must match the "
                             f"target's ({runner.num_blocks} of {runner.block_size}): they share its block tables")
        if lora is not None and (runner.lora is None or speculative is not None):
            raise ValueError("LoRA adapters need a runner with the LoRA graph, and no speculative decoding (not yet "
                             "served with adapters)")
        self.lora = lora
        self.runner = runner
        switch = runner.layout.longrope_switch  # LongRoPE models only (longrope.py)
        self.blocks = BlockManager(runner.num_blocks, runner.block_size, prefix_caching, switch)
        # itl_ratio: cap a step's prompt tokens so it stays within that many decode steps (step_cost.py)
        self.cost = StepCost(itl_ratio) if itl_ratio else None
        self.speculator = Speculator.from_config(speculative, max_seq_len, switch) if speculative else None
        self.drafter = DraftProposer(draft, runner.vocab_size, end_ids) if draft is not None else None
        self.scheduler = TokenScheduler(self.blocks, max_rows=max_rows, max_num_tokens=max_num_tokens,
                                        max_queue_size=max_queue_size, capacity=max_seq_len,
                                        speculator=self.speculator, fast_forward=fast_forward, lora=lora)
        self.core = EngineCore(self.scheduler, tokenizer, end_ids=end_ids, capacity=max_seq_len,
                               max_beam_width=max_beam_width)

    @property
    def end_ids(self) -> tuple[int, ...]:
        return self.core.end_ids

    @property
    def has_work(self) -> bool:
        return self.core.has_work

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    logprobs: int | None = None, guide: GuideMatcher | None = None,
                    adapter: str | None = None) -> Sequence:
        """Queue a request; raises ValueError for a request that cannot run (the core's checks, and a
        prompt the KV pool cannot hold at all: a full pool only queues it; UnknownAdapter for an adapter the model
        does not serve) and QueueFull when busy. `logprobs`: record its tokens' log probabilities with that many
        alternatives (logprobs.py); `guide`: constrain its tokens to a compiled grammar (grammar.py); `adapter`: the
        name of the LoRA adapter it runs under (None: the base model)."""
        if adapter is not None and self.lora is None:
            raise UnknownAdapter(f"lora_name: this model serves no LoRA adapters (got {adapter!r})")
        ref = self.lora.store.resolve(adapter) if adapter is not None else None
        # a beam request's first step: its prompt's blocks, and at most one more block per beam
        needed = self.blocks.blocks_for(len(prompt_ids) + 1) if params.beam_width == 1 else \
            self.blocks.blocks_for(len(prompt_ids)) + params.beam_width
        if needed > self.blocks.num_blocks:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens; with room for one more it needs {needed} KV "
                             f"blocks and the whole pool has {self.blocks.num_blocks} (limits.kv_cache_tokens)")
        seq = self.core.sequence(request_id, prompt_ids, params, logprobs, guide, ref)
        if seq.params.beam_width > 1:  # its search, before it is queued
            beam.start(seq, self.core.capacity)
            longrope.check_beams(self.blocks.longrope_switch, len(prompt_ids), seq.beam.max_new_tokens)
        return self.core.queue(seq)

    def idle(self) -> None:
        """The serving loop has no request to run: adapters loaded at run time go into slots now (lora_slots.py), so
        their first requests find them bound."""
        if self.lora is not None and not self.has_work:
            self.lora.stage(self.runner.lora)

    def adapter_users(self, name: str) -> tuple[int, int]:
        """(running, queued) requests under the LoRA adapter `name` (any digest): what an unload waits for."""
        return self.core.adapter_users(name)

    def cancel(self, request_id: str) -> None:
        """Stop a request at the next step; its blocks are freed then."""
        self.core.cancel(request_id)

    def abort_all(self) -> None:
        """Drop every request (after a failed step, whose state cannot be trusted); blocks are freed."""
        self.core.abort_all()

    def close(self) -> None:
        """Free the models and their KV pools (no step may be running)."""
        self.runner.close()
        if self.drafter is not None:
            self.drafter.close()

    def cache_state(self) -> CacheState:
        b, s, spec = self.blocks, self.scheduler, self.speculator
        return CacheState(s.num_running, s.num_waiting, b.num_used / b.num_blocks,
                          {"used": b.num_used, "free": b.num_free, "cached": b.num_cached},
                          b.prefix_queries, b.prefix_hits, s.num_preemptions,
                          spec.num_draft_tokens if spec else 0, spec.num_accepted_tokens if spec else 0)

    def step(self) -> list[StepOutput]:
        with self.core.lock:
            finished = self.core.take_cancelled()
            for seq in self.scheduler.running:
                if not seq.is_finished and seq.num_tokens > self.core.capacity:
                    seq.finish(FinishReason.length)  # the next token would pass max_seq_len
            plan = self.scheduler.schedule(self.cost.prompt_cap if self.cost else None)
        if self.drafter is not None:
            self.drafter.fill(plan)
        sampled: dict[str, list[int]] = {}
        if plan:
            if plan.copies:  # copy-on-write: beams' shared partial blocks, before the step writes them
                self.runner.copy_blocks(plan.copies)
            decoding = plan.num_decode_rows
            start = time.perf_counter()
            logits = self.runner.step(plan.row_steps())
            if self.cost is not None:  # proposals cost what prompt tokens do: compute beside the weights' read
                self.cost.observe(decoding, plan.num_tokens - decoding, time.perf_counter() - start)
            self.scheduler.update_from_output(plan, logits, self.core, sampled)
        return self.core.outputs(list(self.scheduler.running), finished, sampled)
