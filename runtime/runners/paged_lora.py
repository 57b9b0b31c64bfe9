"""The LoRA graph of a paged runner (runtime/runners/paged.py). Where its sites run fused (llmc.LoraDelta), it is the
runner's one session and runs every step: a base-only step's mask rows are all 0, so no site reads an adapter, and
the logits are the base graph's bit for bit (`shared`: the base graph gets no session, whose packed weights would be
a second copy of the base). Otherwise it is a second session over the same block pools, run for a step when any of
its tokens has an adapter (a step with none runs the base graph, at the base graph's cost).

The LoRA graph is the base graph with a branch beside each projection (compiler/lora/graph.py), naming the base
graph's weights file: its extra inputs are each site's flat A and B stacks and the column masks (runtime/lora/
sites.py). A step binds the distinct adapters its rows use, one slot each in a fixed order (name, then digest),
padded to the highest rank among them. Stacking copies every site's A and B (tens of MB for a 135M model at rank 16),
so the stacks bound are kept and rebound only when the step's set of adapters changes: steady decoding over the same
requests binds only the masks, and not even those while its rows' slots stay the same. When the set changes but
keeps its size and rank (one adapter's requests end as another's begin), the adapters that stay keep their slots and
only the new one's columns of each A and rows of each B are rewritten. Where the session runs each site as
llmc.LoraDelta (runtime/kernels/lora_fusion.py: `keep_stale`), a step reads its tokens' own slots only, so an adapter
whose requests ended keeps its slot, unread, until a new adapter takes it: a step whose adapters are a subset of
those bound restacks nothing, and a new adapter fills a stale slot. The four-node branch multiplies every token by
every bound slot, so there the stacks follow the step's set exactly.

An adapter loaded while the model serves is written into a slot before its first request (`stage`, which the serving
loop calls while it has no work: runtime/engine/lora_slots.py): the slot of the adapter used longest ago, or the first
slot when none is bound yet. Its first request then finds it bound, as a warm adapter's does, instead of paying for
the copy in its prefill step (8 ms for SmolLM2's 23 MB at rank 16). Only where stale slots are kept, and at no higher
rank than the slots'.

A LoRA graph built before the flat layout (its `lora_slots` input) is refused, naming the rebuild.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from llmc.runtime.lora.sites import OLD_SLOTS, Site, a_name, b_name, mask_names
from llmc.runtime.lora.stacks import AdapterWeights, empty_stacks, fill_slot, slot_masks, stack_slots


class LoraGraph:
    def __init__(self, session, sites: Sequence[Site], base_inputs: list[str], path: Path, keep_stale: bool = False,
                 shared: bool = False):
        """`session`: ONNX Runtime's over the LoRA graph at `path`; `base_inputs`: the base graph's inputs, in order,
        which the LoRA graph must begin with; `keep_stale`: its sites read only their tokens' own slots
        (llmc.LoraDelta), so slots of adapters a step does not use may stay bound; `shared`: this session runs the
        base-only steps too (their rows' masks all 0: no slot read), there being no base session."""
        self.session, self.sites = session, list(sites)
        got = [i.name for i in session.get_inputs()]
        if OLD_SLOTS in got:
            raise ValueError(f"{path} was built by an earlier llmc with the stacked-slot LoRA layout (its {OLD_SLOTS} "
                             f"input, [S, in, M*R] stacks); this llmc binds flat slots (docs/lora.md): rebuild the "
                             f"model with `llmc build`")
        extra = {*mask_names(sites), *(a_name(s) for s in sites), *(b_name(s) for s in sites)}
        if got[:len(base_inputs)] != base_inputs or set(got[len(base_inputs):]) != extra:
            missing = sorted(extra - set(got))[:3]
            raise ValueError(f"{path} is not the base graph with the manifest's LoRA sites: its inputs "
                             f"{'lack ' + ', '.join(missing) if missing else 'differ from the base graph and sites'}")
        self.binding = None  # the runner's: its pools bound as past and present
        self.keep_stale, self.shared = keep_stale, shared
        self._bound: tuple = ()  # the adapters whose stacks are bound, in slot order
        self._rank = 0  # the rank their slots are padded to
        self._stacks: dict[str, np.ndarray] = {}  # kept alive while bound
        self._slots_key: bytes | None = None  # the token slots whose masks are bound (None: none bound)
        self._masks: dict[str, np.ndarray] = {}
        self.token_slots = np.zeros(0, np.int64)
        self._binds = 0  # steps bound so far
        self._used: list[int] = []  # per slot: the last step (of `_binds`) whose tokens read it
        self.num_stackings = 0  # times the step's set of adapters changed and the stacks were rebuilt
        self.num_refills = 0  # times it changed and only the changed slots were rewritten
        self.num_stagings = 0  # adapters written into a slot ahead of their first request

    def bind(self, adapters: Sequence[AdapterWeights | None], lengths: Sequence[int]) -> None:
        """Bind a step's LoRA inputs: row i brings `lengths[i]` tokens under `adapters[i]` (None: the base)."""
        distinct = {a.ref: a for a in adapters if a is not None}
        if not distinct and not self.shared:
            raise ValueError("a step with no adapter runs the base graph, not the LoRA graph")
        if not distinct and not self._stacks:  # the first step, base-only: stacks of no slot at all
            self._stacks = empty_stacks(self.sites)
            for name, value in self._stacks.items():
                self.binding.bind_cpu_input(name, value)
        elif distinct and not (set(distinct) <= set(self._bound) if self.keep_stale else
                               set(distinct) == set(self._bound)):
            self._restack(distinct)
        slot = {ref: s for s, ref in enumerate(self._bound)}
        self._binds += 1
        for ref in distinct:
            self._used[slot[ref]] = self._binds
        slots = np.repeat(np.array([-1 if a is None else slot[a.ref] for a in adapters], dtype=np.int64),
                          np.asarray(lengths, dtype=np.int64))
        key = slots.tobytes()
        if key != self._slots_key:
            self._masks = slot_masks(self.sites, slots, len(self._bound), self._rank)
            for name, value in self._masks.items():
                self.binding.bind_cpu_input(name, value)
            self._slots_key = key
        self.token_slots = slots  # each token's slot (-1: none), as the masks bound have it

    def _restack(self, distinct: dict) -> None:
        """Stacks for the step's adapters. When as many as before come in at no higher rank, the adapters that stay
        keep their slots and only the slots of those that changed are rewritten (a request for another adapter
        replacing a finished one costs that adapter's copy); with `keep_stale`, as many new ones as there are slots of
        adapters the step does not use. Otherwise every slot is stacked, in a fixed order."""
        free = sum(ref not in distinct for ref in self._bound)
        new = sum(ref not in self._bound for ref in distinct)
        if (free >= new if self.keep_stale else len(distinct) == len(self._bound)) and \
                max(a.rank for a in distinct.values()) <= self._rank:
            order = [ref if ref in distinct else None for ref in self._bound]
            incoming = iter(sorted((r for r in distinct if r not in self._bound), key=lambda r: (r.name, r.digest)))
            for s, ref in enumerate(order):
                if ref is None:
                    order[s] = next(incoming, None)
                    if order[s] is None:  # a stale slot no new adapter takes: it stays as it was, unread
                        order[s] = self._bound[s]
                        continue
                    fill_slot(self.sites, self._stacks, s, distinct[order[s]], self._rank)
            self._used = [u if ref in self._bound else 0 for u, ref in zip(self._used, order)]
            self._bound = tuple(order)
            self.num_refills += 1
            self._slots_key = None  # the same slot numbers may name other adapters now: rebind the masks
            return  # the stacks were rewritten in place: their binding stands
        ordered = sorted(distinct.values(), key=lambda a: (a.ref.name, a.ref.digest))
        self._rank = max(a.rank for a in ordered)
        self._stacks = stack_slots(self.sites, ordered, self._rank)
        self._bound = tuple(a.ref for a in ordered)
        self._used = [0] * len(ordered)
        self._slots_key = None
        self.num_stackings += 1
        for name, value in self._stacks.items():
            self.binding.bind_cpu_input(name, value)

    @property
    def bound(self) -> tuple:
        """The adapters whose stacks are bound, in slot order."""
        return self._bound

    def stage(self, adapter: AdapterWeights) -> bool:
        """Write `adapter` into a slot ahead of its first request (call between steps, with no request running): the
        slot read longest ago, or stacks of its one slot when none is bound. False where it is bound already, or
        cannot be staged: the four-node branch (its stacks follow each step's set), or a rank above the slots'."""
        if not self.keep_stale or adapter.ref in self._bound:
            return False
        if not self._bound:
            self._restack({adapter.ref: adapter})
        elif adapter.rank <= self._rank:
            s = min(range(len(self._bound)), key=self._used.__getitem__)
            fill_slot(self.sites, self._stacks, s, adapter, self._rank)
            self._bound = self._bound[:s] + (adapter.ref,) + self._bound[s + 1:]
            self._used[s] = 0
            self._slots_key = None  # slot s names another adapter now: rebind the masks
        else:
            return False
        self.num_stagings += 1
        return True

    def close(self) -> None:
        self.session, self.binding, self._stacks, self._bound, self._masks = None, None, {}, (), {}
