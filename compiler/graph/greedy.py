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

from typing import Callable

import numpy as np

from llmc.compiler.graph.routing import RoutingMargins
from llmc.runtime.engine import longrope
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


def runner_greedy(runner: Runner, prompts: list[list[int]], steps: int, tick: Callable[[], None]) -> list[Decoded]:
    """Each prompt prefilled alone into slot r, then all rows decoded together at their own positions;
    a LongRoPE row that grows past the switch prefills its whole sequence again in its slot, as the
    slot engine does (runtime/engine/longrope.py)."""
    switch, prefills, lasts, seqs = runner.layout.longrope_switch, [], [], []
    for row, prompt in enumerate(prompts):
        logits = _prefill_slot(runner, row, list(prompt))
        prefills.append(logits[0])
        lasts.append([logits[0, -1]])
        seqs.append(list(prompt))
    positions = np.array([len(p) for p in prompts], dtype=np.int64)
    for _ in range(steps - 1):
        tokens = np.array([[int(last[-1].argmax())] for last in lasts])
        logits = runner.step(tokens, positions, first_row=0, sequence_lengths=positions + 1)
        positions += 1
        for row, last in enumerate(lasts):
            seqs[row].append(int(tokens[row, 0]))
            if longrope.crossed(switch, len(seqs[row])):
                logits[row] = _prefill_slot(runner, row, seqs[row])[0, -1:]
            last.append(logits[row, -1])
        tick()
    tick()
    return list(zip(prefills, lasts))


def _prefill_slot(runner: Runner, row: int, tokens: list[int]) -> np.ndarray:
    """`tokens` as the whole sequence of slot `row`: logits [1, len(tokens), V]."""
    return runner.step(np.array([tokens]), np.zeros(1, dtype=np.int64), first_row=row,
                       sequence_lengths=np.array([len(tokens)]))


def paged_blocks(prompts: list[list[int]], steps: int, block_size: int, seed: int = 0) -> list[list[int]]:
    """Each row's blocks, enough for its prompt and `steps` tokens, drawn shuffled from one pool (rows
    interleave in memory, as under a block manager)."""
    needs = [-(-(len(p) + steps) // block_size) for p in prompts]
    order = np.random.default_rng(seed).permutation(sum(needs)).tolist()
    return [order[sum(needs[:r]):sum(needs[:r + 1])] for r in range(len(prompts))]


def paged_greedy(runner: PagedRunner, prompts: list[list[int]], steps: int, tick: Callable[[], None],
                 chunk: int | None = None, blocks: list[list[int]] | None = None) -> list[Decoded]:
    """Row r joins at step r and feeds its prompt `chunk` tokens a step (whole when None), asking for
    every prompt token's logits, then decodes greedily beside the others until it has `steps` tokens'
    logits: steps mix decoding rows with prompt chunks, all in one call of the graph each. Each row
    carries its sequence's length, and a LongRoPE row that grows past the switch feeds its whole
    sequence again, as the paged engine does (runtime/engine/longrope.py)."""
    blocks = blocks or paged_blocks(prompts, steps, runner.block_size)
    switch = runner.layout.longrope_switch
    prefills: list[list[np.ndarray]] = [[] for _ in prompts]
    lasts: list[list[np.ndarray]] = [[] for _ in prompts]
    seqs = [list(p) for p in prompts]  # each row's tokens so far
    long = [longrope.is_long(switch, len(p)) for p in prompts]  # its KV's RoPE table
    fed, step = [0] * len(prompts), 0
    while any(len(last) < steps for last in lasts):
        rows, live = [], [r for r in range(min(step + 1, len(prompts))) if len(lasts[r]) < steps]
        for r in live:
            if fed[r] < len(prompts[r]):
                tokens = prompts[r][fed[r]:fed[r] + (chunk or len(prompts[r]))]
                rows.append(RowStep(tokens, fed[r], blocks[r], num_logits=len(tokens), seq_len=len(seqs[r])))
            elif longrope.must_recompute(switch, long[r], len(seqs[r])):
                long[r] = True
                rows.append(RowStep(seqs[r], 0, blocks[r], seq_len=len(seqs[r])))
            else:
                rows.append(RowStep(seqs[r][-1:], fed[r], blocks[r], seq_len=len(seqs[r])))
        logits = runner.step(rows)
        at = 0
        for r, row in zip(live, rows):
            out, at = logits[at:at + row.num_logits], at + row.num_logits
            if fed[r] < len(prompts[r]):  # a prompt chunk
                prefills[r].extend(out)
            fed[r] = row.past_len + len(row.token_ids)
            if fed[r] >= len(prompts[r]):
                lasts[r].append(out[-1])
                seqs[r].append(int(out[-1].argmax()))
                tick()
        step += 1
    return [(np.stack(p), last) for p, last in zip(prefills, lasts)]
