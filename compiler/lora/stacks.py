"""A PEFT adapter (adapter.py) laid out per site as the runtime stacks it (runtime/lora/stacks.py): what the build
writes into the model repository for each adapter, and what the tests stack straight from PEFT's adapters.

Site t of an adapter whose highest rank is r: module m of the site (the site's m-th PEFT module, at output columns
offset .. offset + width) at columns m*r .. m*r + its rank of a (lora_A transposed: [in, M*r]) and the same rows
of b (lora_B transposed, times PEFT's scaling: [M*r, out]) in m's columns only; everything else 0. A site none of
whose modules the adapter targets is left out. An expert site's are every expert's: a [E, in, r], b [E, r, out].
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from llmc.compiler.lora.adapter import Adapter
from llmc.compiler.lora.experts import op_rows
from llmc.compiler.lora.fold import Fold
from llmc.runtime.lora import stacks
from llmc.runtime.lora.sites import Site, stack_shapes
from llmc.runtime.lora.stacks import AdapterRef, AdapterWeights, slot_masks, token_slots


def site_arrays(sites: Sequence[Site], adapter: Adapter, fold: Fold | None = None) -> AdapterWeights:
    """`adapter` per site, ready to stack, with `fold` (a base AWQ scaled: fold.py) folded in. A module no site
    computes is an error (check_against refuses such adapters before they get here)."""
    placed = {m.module: (site, k) for site in sites for k, m in enumerate(site.members)}
    unknown = sorted(set(adapter.modules) - set(placed))
    if unknown:
        raise ValueError(f"adapter {adapter.name!r}: no site computes {', '.join(unknown)}")
    r = adapter.max_rank
    arrays: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for module, lora in adapter.modules.items():
        site, k = placed[module]
        if site.experts:  # every expert's pair: a [E, in, r], b [E, r, out] in the op's output order (experts.py)
            a, b = (np.zeros(shape, np.float32) for shape in stack_shapes(site, r))
            a[..., :lora.rank] = lora.a.transpose(0, 2, 1)
            b[:, :lora.rank] = lora.scaling * op_rows(lora.b.transpose(0, 2, 1), site.interleave)
            arrays[site.name] = a, b
            continue
        if site.name not in arrays:
            width = len(site.members) * r
            arrays[site.name] = (np.zeros((site.in_features, width), np.float32),
                                 np.zeros((width, site.out_features), np.float32))
        a, b = arrays[site.name]
        member = site.members[k]
        a[:, k * r:k * r + lora.rank] = lora.a.T
        b[k * r:k * r + lora.rank, member.offset:member.offset + member.width] = lora.scaling * lora.b.T
    for name, (a, b) in arrays.items() if fold else ():
        fold.apply(name, a, b)
    return AdapterWeights(AdapterRef(adapter.name, adapter.digest), r, arrays)


def stack_slots(sites: Sequence[Site], adapters: Sequence[Adapter], rank: int | None = None,
                fold: Fold | None = None) -> dict[str, np.ndarray]:
    """The flat stacks of every site for `adapters` (PEFT adapters read by adapter.py) in slots 0, 1, ...: the
    runtime's stacking (runtime/lora/stacks.py) of their per-site arrays."""
    return stacks.stack_slots(sites, [site_arrays(sites, a, fold) for a in adapters], rank)


def step_inputs(sites: Sequence[Site], adapters: Sequence[Adapter], rows: Sequence[tuple[int, int]],
                fold: Fold | None = None) -> dict[str, np.ndarray]:
    """Every LoRA input of a step (the graph's, runtime/lora/sites.py) whose rows are (tokens, slot or -1) with
    `adapters` in slots 0, 1, ...: the flat stacks at the highest rank among them and the column masks."""
    rank = max(a.max_rank for a in adapters)
    return {**stack_slots(sites, adapters, rank, fold), **slot_masks(sites, token_slots(rows), len(adapters), rank)}


__all__ = ["site_arrays", "slot_masks", "stack_slots", "step_inputs", "token_slots"]
