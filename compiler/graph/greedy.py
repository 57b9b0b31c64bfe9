"""The greedy decodes the verify stage compares (verify.py), each as the thing it stands for runs:

    torch_greedy    the HF PyTorch model alone on one prompt, as its generate() decodes
    runner_greedy   a slot graph as serving drives it: each prompt prefilled into its own slot, then
                    every row decoding in one batch at its own position
    paged_greedy    a paged graph as its engine drives it: rows joining a step apart, prompts fed in
                    chunks beside the rows that decode

Each returns, per prompt, its prefill logits [L, V] and each step's logits [V] (`Decoded`). The TensorRT
engine check (compiler/tensorrt/verify_engine.py) and tests decode with them too.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from llmc.compiler.graph.routing import RoutingMargins
from llmc.runtime.engine import longrope
from llmc.runtime.lora.stacks import AdapterWeights
from llmc.runtime.runners.paged import PagedRunner, RowStep
from llmc.runtime.runners.protocol import Runner

Decoded = tuple[np.ndarray, list[np.ndarray]]  # prefill logits [L, V], each step's logits [V]


def cache_kwarg(model) -> str:
    """The name the model's forward takes (and its output returns) the KV cache under: `cache` in
    recent transformers 5.x (`past_key_values` still works there but warns), `past_key_values` before."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def torch_greedy(model, prompt: list[int], steps: int, tick: Callable[[], None],
                 margins: RoutingMargins | None = None) -> Decoded:
    """The HF model alone on one prompt: prefill + `steps` greedy steps with its own KV cache, as its
    generate() runs them: a LongRoPE model's cache is dropped and the whole sequence recomputed when it
    first grows past `original_max_position_embeddings` (Phi3ForCausalLM.prepare_inputs_for_generation).
    `margins`: told where each call's tokens sit, for a mixture's routing record (routing.py)."""
    import torch

    from llmc.compiler.models.config import longrope_switch

    def at(start: int) -> None:
        if margins is not None:
            margins.at(start)

    cache_name, switch = cache_kwarg(model), longrope_switch(model.config)
    with torch.no_grad():
        at(0)
        out = model(input_ids=torch.tensor([prompt]), use_cache=True)
        prefill, cache = out.logits[0].float().numpy(), getattr(out, cache_name)
        last, tokens = [prefill[-1]], list(prompt)
        for _ in range(steps - 1):
            tokens.append(int(last[-1].argmax()))
            if longrope.crossed(switch, len(tokens)):
                at(0)
                out = model(input_ids=torch.tensor([tokens]), use_cache=True)
            else:
                at(len(tokens) - 1)
                out = model(input_ids=torch.tensor([tokens[-1:]]), use_cache=True, **{cache_name: cache})
            cache = getattr(out, cache_name)
            last.append(out.logits[0, -1].float().numpy())
            tick()
    tick()
    return prefill, last


def runner_greedy(runner: Runner, prompts: list[list[int]], steps: int, tick: Callable[[], None],
                  adapters: Sequence[AdapterWeights | None] | None = None) -> list[Decoded]:
    """Each prompt prefilled alone into slot r, then all rows decoded together at their own positions;
    a LongRoPE row that grows past the switch prefills its whole sequence again in its slot, as the
    slot engine does (runtime/engine/longrope.py). `adapters`: row r's LoRA adapter (None: the base), for a runner
    with a LoRA graph."""
    switch, prefills, lasts, seqs = runner.layout.longrope_switch, [], [], []
    lora = (lambda rows: {"adapters": [adapters[r] for r in rows]}) if adapters is not None else (lambda rows: {})
    for row, prompt in enumerate(prompts):
        logits = _prefill_slot(runner, row, list(prompt), lora([row]))
        prefills.append(logits[0])
        lasts.append([logits[0, -1]])
        seqs.append(list(prompt))
    positions = np.array([len(p) for p in prompts], dtype=np.int64)
    for _ in range(steps - 1):
        tokens = np.array([[int(last[-1].argmax())] for last in lasts])
        logits = runner.step(tokens, positions, first_row=0, sequence_lengths=positions + 1,
                             **lora(range(len(prompts))))
        positions += 1
        for row, last in enumerate(lasts):
            seqs[row].append(int(tokens[row, 0]))
            if longrope.crossed(switch, len(seqs[row])):
                logits[row] = _prefill_slot(runner, row, seqs[row], lora([row]))[0, -1:]
            last.append(logits[row, -1])
        tick()
    tick()
    return list(zip(prefills, lasts))


def _prefill_slot(runner: Runner, row: int, tokens: list[int], lora: dict) -> np.ndarray:
    """`tokens` as the whole sequence of slot `row`: logits [1, len(tokens), V]."""
    return runner.step(np.array([tokens]), np.zeros(1, dtype=np.int64), first_row=row,
                       sequence_lengths=np.array([len(tokens)]), **lora)


def paged_blocks(prompts: list[list[int]], steps: int, block_size: int, seed: int = 0) -> list[list[int]]:
    """Each row's blocks, enough for its prompt and `steps` tokens, drawn shuffled from one pool (rows
    interleave in memory, as under a block manager)."""
    needs = [-(-(len(p) + steps) // block_size) for p in prompts]
    order = np.random.default_rng(seed).permutation(sum(needs)).tolist()
    return [order[sum(needs[:r]):sum(needs[:r + 1])] for r in range(len(prompts))]


def paged_greedy(runner: PagedRunner, prompts: list[list[int]], steps: int, tick: Callable[[], None],
                 chunk: int | None = None, blocks: list[list[int]] | None = None,
                 adapters: Sequence[AdapterWeights | None] | None = None) -> list[Decoded]:
    """Row r joins at step r and feeds its prompt `chunk` tokens a step (whole when None), asking for
    every prompt token's logits, then decodes greedily beside the others until it has `steps` tokens'
    logits: steps mix decoding rows with prompt chunks, all in one call of the graph each (PagedSchedule).
    `adapters`: row r's LoRA adapter (None: the base), for a runner with a LoRA graph."""
    schedule = PagedSchedule(prompts, steps, runner.block_size, runner.layout.longrope_switch, chunk, blocks,
                             adapters)
    while not schedule.finished():
        schedule.take(runner.step(schedule.next_rows()), lambda r, k, out: int(out.argmax()), tick)
    return schedule.decoded()


class PagedSchedule:
    """The steps paged_greedy runs: row r joins at step r and feeds its prompt `chunk` tokens a step (whole when
    None), then one token a step, until it has `steps` tokens' logits. Each row carries its sequence's length,
    and a LongRoPE row that grows past the switch feeds its whole sequence again, as the paged engine does
    (runtime/engine/longrope.py). Which token a row feeds next is the caller's (`take`'s `choose`): its greedy
    choice, or a continuation fixed in advance (graph/segmented_candidate.py), whose steps are known before any
    runs. `adapters`: row r's LoRA adapter, carried by each of its RowSteps (None: the base model)."""

    def __init__(self, prompts: list[list[int]], steps: int, block_size: int, switch: int | None,
                 chunk: int | None = None, blocks: list[list[int]] | None = None,
                 adapters: Sequence[AdapterWeights | None] | None = None):
        self.prompts, self.steps, self.switch, self.chunk = prompts, steps, switch, chunk
        self.adapters = list(adapters) if adapters is not None else [None] * len(prompts)
        self.blocks = blocks or paged_blocks(prompts, steps, block_size)
        self.prefills: list[list[np.ndarray]] = [[] for _ in prompts]
        self.lasts: list[list[np.ndarray]] = [[] for _ in prompts]
        self.seqs = [list(p) for p in prompts]  # each row's tokens so far
        self.long = [longrope.is_long(switch, len(p)) for p in prompts]  # its KV's RoPE table
        self.fed, self.step, self._live = [0] * len(prompts), 0, []

    def finished(self) -> bool:
        return all(len(last) >= self.steps for last in self.lasts)

    def next_rows(self) -> list[RowStep]:
        rows, prompts = [], self.prompts
        self._live = [r for r in range(min(self.step + 1, len(prompts))) if len(self.lasts[r]) < self.steps]
        for r in self._live:
            if self.fed[r] < len(prompts[r]):
                tokens = prompts[r][self.fed[r]:self.fed[r] + (self.chunk or len(prompts[r]))]
                rows.append(RowStep(tokens, self.fed[r], self.blocks[r], num_logits=len(tokens),
                                    seq_len=len(self.seqs[r]), adapter=self.adapters[r]))
            elif longrope.must_recompute(self.switch, self.long[r], len(self.seqs[r])):
                self.long[r] = True
                # a copy: the row's list grows on, and a planned step (forced tokens) runs after the plan is made
                rows.append(RowStep(list(self.seqs[r]), 0, self.blocks[r], seq_len=len(self.seqs[r]),
                                    adapter=self.adapters[r]))
            else:
                rows.append(RowStep(self.seqs[r][-1:], self.fed[r], self.blocks[r], seq_len=len(self.seqs[r]),
                                    adapter=self.adapters[r]))
        self._rows = rows
        return rows

    def take(self, logits: np.ndarray, choose: Callable[[int, int, np.ndarray], int],
             tick: Callable[[], None] | None = None) -> None:
        """The logits of the step `next_rows` gave; `choose(row, k, logits)` is row's token after its k-th step."""
        at = 0
        for r, row in zip(self._live, self._rows):
            out, at = logits[at:at + row.num_logits], at + row.num_logits
            if self.fed[r] < len(self.prompts[r]):  # a prompt chunk
                self.prefills[r].extend(out)
            self.fed[r] = row.past_len + len(row.token_ids)
            if self.fed[r] >= len(self.prompts[r]):
                self.lasts[r].append(out[-1])
                self.seqs[r].append(choose(r, len(self.lasts[r]) - 1, out[-1]))
                if tick:
                    tick()
        self.step += 1

    def decoded(self) -> list[Decoded]:
        return [(np.stack(p), last) for p, last in zip(self.prefills, self.lasts)]
