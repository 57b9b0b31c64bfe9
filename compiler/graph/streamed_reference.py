"""The verify stage's reference, streamed: the checkpoint's own PyTorch model, one decoder layer at a time,
teacher-forced on the candidate's greedy tokens.

A greedy decode runs the whole model once per step; read layer by layer from the checkpoint, that is every
weight read again each step. Instead each row's prompt and the candidate's tokens go through the model in one
forward (model.StreamedModel.streaming: each layer read once for all rows), and step k's reference logits
are read at position len(prompt) - 1 + k. Up to a row's first divergence the candidate's tokens are the
reference's own greedy tokens, so the logits compared there, the tokens compared and the margin at the first
divergence are what a decode would give (verify.compare); past it, a token is the reference's choice given
the candidate's prefix. The rows go in one batch, right-padded: causal attention never lets a position see the
padding after it.

LongRoPE (Phi-3) switches every position's table once a sequence outgrows `original_max_position_embeddings`,
and generate() recomputes the cache there: a row that crosses the switch also runs cut at the switch, and the
positions a shorter sequence produced are read from that forward (`_positions`). A mixture's routing margins are
recorded per row (graph/routing.py).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from llmc.compiler.graph import routing
from llmc.compiler.graph.greedy import Decoded
from llmc.compiler.models.config import longrope_switch
from llmc.compiler.stream.model import StreamedModel


def _forward(streamed: StreamedModel, rows: list[list[int]], tick: Callable[[], None]):
    """Each row's logits [len, V] and routing margins [len] (None for a dense model), in one streamed forward."""
    import torch

    width = max(map(len, rows))
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, :len(row)], mask[r, :len(row)] = torch.tensor(row), 1
    handles = [layer.register_forward_hook(lambda *args: tick()) for layer in streamed.layers]
    try:
        with torch.no_grad(), streamed.streaming(), routing.recording(streamed.model) as margins:
            logits = streamed.model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float().numpy()
    finally:
        for handle in handles:
            handle.remove()
    by_row = None if margins is None else margins.margins.reshape(len(rows), width)
    return ([logits[r, :len(row)] for r, row in enumerate(rows)],
            [None if by_row is None else by_row[r, :len(row)] for r, row in enumerate(rows)])


def _regimes(prompt_len: int, row_len: int, switch: int | None) -> set[str]:
    """Which forwards a row's logits come from: "all" without LongRoPE; "short" (cut at the switch) for the
    positions of a sequence no longer than the switch, "long" for those of a longer one."""
    if switch is None:
        return {"all"}
    return ({"short"} if prompt_len <= switch else set()) | ({"long"} if row_len > switch else set())


def forwards(streamed: StreamedModel, prompts: list[list[int]], steps: int) -> int:
    """How many layer passes `teacher_forced` makes (its progress total, in layers)."""
    switch = longrope_switch(streamed.model.config)
    return streamed.num_layers * len(set().union(*(_regimes(len(p), len(p) + steps - 1, switch) for p in prompts)))


def teacher_forced(streamed: StreamedModel, prompts: list[list[int]], tokens: list[list[int]], steps: int,
                   tick: Callable[[], None]) -> tuple[list[Decoded], list[np.ndarray | None]]:
    """The reference's Decoded for each prompt fed `tokens` (the candidate's greedy tokens, at least
    `steps` - 1 of them), and each row's routing margins per position (None for a dense model)."""
    switch = longrope_switch(streamed.model.config)
    rows = [list(p) + list(t[:steps - 1]) for p, t in zip(prompts, tokens)]
    runs: dict[str, list[list[int]]] = {"all": [], "short": [], "long": []}  # the sequences each forward runs
    at: list[dict[str, int]] = []  # per row: regime -> its sequence's index in that forward
    for prompt, row in zip(prompts, rows):
        at.append({})
        for regime in _regimes(len(prompt), len(row), switch):
            at[-1][regime] = len(runs[regime])
            runs[regime].append(row[:switch] if regime == "short" else row)
    done = {name: _forward(streamed, seqs, tick) for name, seqs in runs.items() if seqs}
    decoded, margins = [], []
    for prompt, where in zip(prompts, at):
        logits, margin = _positions(done, where, switch)
        decoded.append((logits[:len(prompt)], [logits[len(prompt) - 1 + k] for k in range(steps)]))
        margins.append(margin)
    return decoded, margins


def _positions(done, where: dict[str, int], switch: int | None):
    """A row's logits per position and its margins, each position from the forward whose sequence length matches
    the one that produced it in a decode (the prompt's length for the prompt, p + 1 for a step's position p): the
    long forward's, its first `switch` positions from the short forward where the row has both."""
    got = {regime: (done[regime][0][i], done[regime][1][i]) for regime, i in where.items()}
    logits, margin = got.get("long") or got.get("all") or got["short"]
    if "long" in got and "short" in got:
        logits = logits.copy()
        logits[:switch] = got["short"][0]  # positions p < switch: a sequence of max(p + 1, prompt) <= switch tokens
    return logits, margin
