"""A step's LoRA inputs: the adapters in its slots laid out as the branch's stacks (graph.py), and each token's
slot. NumPy arithmetic only: what the runtime will do every step it changes the slots (docs/lora.md: the next
slice moves this beside the runner, which imports no compiler, with the input names and the site table).

Slot s of site t holds adapter s's modules of that site: module m (the site's m-th PEFT module, at output
columns offset .. offset + width) at rank columns m*R .. m*R + r of A (lora_A transposed: [in, r]) and the
same rows of B (lora_B transposed, times PEFT's scaling: [r, width]) in m's columns only; everything else 0.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from llmc.compiler.lora.adapter import Adapter
from llmc.compiler.lora.graph import SLOTS, a_name, b_name
from llmc.compiler.lora.sites import Site


def stack_slots(sites: list[Site], adapters: Sequence[Adapter], rank: int | None = None) -> dict[str, np.ndarray]:
    """The stacks of every site for `adapters` in slots 0, 1, ... (at least one); `rank`: the R the stacks are
    padded to (default: the highest rank among the adapters). A module of an adapter that no site computes is an
    error (check_against refuses such adapters before they reach a slot)."""
    if not adapters:
        raise ValueError("a step with LoRA inputs has at least one slot; run the base graph when it has none")
    r_max = max(a.max_rank for a in adapters) if rank is None else rank
    placed = {m.module: (site, k) for site in sites for k, m in enumerate(site.members)}
    for adapter in adapters:
        unknown = sorted(set(adapter.modules) - set(placed))
        if unknown:
            raise ValueError(f"adapter {adapter.name!r}: no site computes {', '.join(unknown)}")
        if adapter.max_rank > r_max:
            raise ValueError(f"adapter {adapter.name!r} has rank {adapter.max_rank}, above the stacks' {r_max}")
    feeds = {}
    for site in sites:
        width = len(site.members) * r_max
        feeds[a_name(site)] = np.zeros((len(adapters), site.in_features, width), np.float32)
        feeds[b_name(site)] = np.zeros((len(adapters), width, site.out_features), np.float32)
    for s, adapter in enumerate(adapters):
        for module, lora in adapter.modules.items():
            site, k = placed[module]
            member, r = site.members[k], lora.rank
            feeds[a_name(site)][s, :, k * r_max:k * r_max + r] = lora.a.T
            feeds[b_name(site)][s, k * r_max:k * r_max + r, member.offset:member.offset + member.width] = \
                lora.scaling * lora.b.T
    return feeds


def token_slots(rows: Sequence[tuple[int, int]]) -> np.ndarray:
    """`lora_slots` for a step's rows given as (tokens, slot or -1), in the order the step packs them."""
    return np.concatenate([np.full(n, slot, np.int64) for n, slot in rows]) if rows else np.zeros(0, np.int64)


__all__ = ["SLOTS", "stack_slots", "token_slots"]
