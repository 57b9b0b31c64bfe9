"""A step's LoRA inputs: the adapters in its slots laid out as the branch's flat stacks (sites.py), and the column
masks that keep each token to its own slot.
NumPy only; the runner (runtime/runners/paged_lora.py) stacks a step's adapters when the set it binds changes.

An adapter is held as the build wrote it (files.py), per site and ready to stack: `AdapterWeights.sites[site]` is
(a [in, M*r], b [M*r, out]) for the adapter's own rank r (its highest), module m of the site in columns (rows of b)
m*r .. m*r + its rank, zeros beyond; b with PEFT's scaling folded in and written only into m's output columns.
A site the adapter does not target is absent. Stacking for a step whose highest rank is R copies each module's
block to columns s*M*R + m*R of the flat A (rows of the flat B: sites.py); everything else stays 0, and the column
mask keeps a token's own slot's columns only, so it adds exactly (x A_slot) B_slot.
An expert site's arrays carry the experts in front (a [E, in, r], b [E, r, out]: sites.py), stacked the same way
along their rank axis.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from llmc.runtime.lora.sites import Site, a_name, b_name, mask_name, stack_shapes


@dataclass(frozen=True)
class AdapterRef:
    """An adapter's identity: its name and the sha256 of its contents (the build's digest over its config and
    tensors). An adapter reloaded under the same name with other weights is another adapter."""

    name: str
    digest: str

    @property
    def key(self) -> bytes:
        """What the prefix cache's key chain of this adapter's blocks starts from (runtime/engine/prefix_keys.py)."""
        return hashlib.sha256(b"llmc: lora\0" + self.name.encode() + b"\0" + self.digest.encode()).digest()


@dataclass(frozen=True, eq=False)
class AdapterWeights:
    ref: AdapterRef
    rank: int  # the adapter's highest rank: r of its per-site arrays
    # site -> (a [in, M*r], b [M*r, out]); an expert site's (a [E, in, r], b [E, r, out])
    sites: dict[str, tuple[np.ndarray, np.ndarray]] = field(repr=False)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.sites.values())


def stack_slots(sites: Sequence[Site], adapters: Sequence[AdapterWeights], rank: int | None = None
                ) -> dict[str, np.ndarray]:
    """The flat stacks of every site (sites.py) for `adapters` in slots 0, 1, ... (at least one); `rank`: the R the
    slots are padded to (default: the highest rank among the adapters)."""
    if not adapters:
        raise ValueError("a step with LoRA inputs has at least one slot; run the base graph when it has none")
    r_max = max(a.rank for a in adapters) if rank is None else rank
    known = {site.name for site in sites}
    for adapter in adapters:
        unknown = sorted(set(adapter.sites) - known)
        if unknown:
            raise ValueError(f"adapter {adapter.ref.name!r}: no site {', '.join(unknown)} in this graph")
        if adapter.rank > r_max:
            raise ValueError(f"adapter {adapter.ref.name!r} has rank {adapter.rank}, above the stacks' {r_max}")
    feeds = _zeros(sites, len(adapters), r_max)
    for s, adapter in enumerate(adapters):
        fill_slot(sites, feeds, s, adapter, r_max)
    return feeds


def empty_stacks(sites: Sequence[Site]) -> dict[str, np.ndarray]:
    """Every site's stacks zero slots wide: what a step with no adapter binds."""
    return _zeros(sites, 0, 0)


def _zeros(sites: Sequence[Site], slots: int, rank: int) -> dict[str, np.ndarray]:
    """Every site's flat stacks, all 0, `slots` slots at `rank` wide."""
    stacks = {}
    for site in sites:
        a_shape, b_shape = stack_shapes(site, slots * len(site.members) * rank)
        stacks[a_name(site)], stacks[b_name(site)] = np.zeros(a_shape, np.float32), np.zeros(b_shape, np.float32)
    return stacks


def fill_slot(sites: Sequence[Site], feeds: dict[str, np.ndarray], s: int, adapter: AdapterWeights,
              rank: int) -> None:
    """Write `adapter` into slot `s` of flat stacks made by stack_slots at `rank` (the adapter's within it), in place:
    its columns of each A and rows of each B only, so a slot replaced while the others stay costs one adapter's copy."""
    for site in sites:
        a_stack, b_stack = feeds[a_name(site)], feeds[b_name(site)]
        k = len(site.members) * rank
        a_slot, b_slot = a_stack[..., s * k:(s + 1) * k], b_stack[..., s * k:(s + 1) * k, :]  # views into the stacks
        pair = adapter.sites.get(site.name)
        if pair is None:
            a_slot[...], b_slot[...] = 0.0, 0.0
            continue
        a, b, r = pair[0], pair[1], adapter.rank
        if r == rank:
            a_slot[...], b_slot[...] = a, b
            continue
        a_slot[...], b_slot[...] = 0.0, 0.0
        for m in range(len(site.members)):
            a_slot[..., m * rank:m * rank + r] = a[..., m * r:(m + 1) * r]
            b_slot[..., m * rank:m * rank + r, :] = b[..., m * r:(m + 1) * r, :]


def slot_masks(sites: Sequence[Site], slots: np.ndarray, num_slots: int, rank: int) -> dict[str, np.ndarray]:
    """The column masks (sites.py) for tokens in `slots` (int64 [num_tokens], -1: none) under stacks of `num_slots`
    slots at `rank`: token n's row is 1 in its own slot's columns, so its delta is its own adapter's alone."""
    own = (np.asarray(slots)[:, None] == np.arange(num_slots)[None, :]).astype(np.float32)  # [num_tokens, S]
    return {mask_name(m): np.repeat(own, m * rank, axis=1) for m in sorted({len(site.members) for site in sites})}


def token_slots(rows: Sequence[tuple[int, int]]) -> np.ndarray:
    """Each token's slot (-1: none) for a step's rows given as (tokens, slot or -1), in the order the step packs
    them."""
    return np.concatenate([np.full(n, slot, np.int64) for n, slot in rows]) if rows else np.zeros(0, np.int64)


class StepStacks:
    """A slot runner's LoRA inputs (runtime/runners/ort.py, trt.py): the stacks of a step's distinct adapters, one slot
    each in a fixed order (name, then digest) at the highest rank among them, kept while the set stays; and the masks,
    a row per token shaped like the step's input_ids ([n, S, W]: a slot graph's, compiler/lora/graph.py). A step
    without an adapter binds stacks zero slots wide, whose masks select nothing."""

    def __init__(self, sites: Sequence[Site]):
        self.sites = list(sites)
        self.bound: tuple[AdapterRef, ...] = ()
        self.rank = 0
        self.stacks = empty_stacks(self.sites)
        self.num_stackings = 0  # times the set changed and the stacks were rebuilt (what a device copy follows)

    def inputs(self, adapters: Sequence[AdapterWeights | None], shape: tuple[int, int]) -> dict[str, np.ndarray]:
        """The LoRA inputs of a step of `shape` (n rows, S tokens each), row i under `adapters[i]` (None: the base)."""
        n, s = shape
        if len(adapters) != n:
            raise ValueError(f"a step of {n} rows got {len(adapters)} adapters (one per row, None for the base)")
        distinct = {a.ref: a for a in adapters if a is not None}
        if set(distinct) != set(self.bound):
            ordered = sorted(distinct.values(), key=lambda a: (a.ref.name, a.ref.digest))
            self.rank = max((a.rank for a in ordered), default=0)
            self.stacks = stack_slots(self.sites, ordered, self.rank) if ordered else empty_stacks(self.sites)
            self.bound = tuple(a.ref for a in ordered)
            self.num_stackings += 1
        slot = {ref: k for k, ref in enumerate(self.bound)}
        slots = np.repeat(np.array([-1 if a is None else slot[a.ref] for a in adapters], np.int64), s)
        masks = slot_masks(self.sites, slots, len(self.bound), self.rank)
        return {**self.stacks, **{name: m.reshape(n, s, -1) for name, m in masks.items()}}
