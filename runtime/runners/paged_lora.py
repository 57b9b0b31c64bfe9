"""The LoRA graph of a paged runner (runtime/runners/paged.py): a second session over the same block pools, run for a
step when any of its tokens has an adapter (a step with none runs the base graph, at the base graph's cost).

The LoRA graph is the base graph with a branch beside each projection (compiler/lora/graph.py), naming the base
graph's weights file: its extra inputs are `lora_slots` and each site's A and B stacks (runtime/lora/sites.py). A step
binds the distinct adapters its rows use, one slot each in a fixed order (name, then digest), padded to the highest
rank among them. Stacking copies every site's A and B (tens of MB for a 135M model at rank 16), so the stacks bound
are kept and rebound only when the step's set of adapters changes: steady decoding over the same requests binds
only `lora_slots`. When the set changes but keeps its size and rank (one adapter's requests end as another's
begin), the adapters that stay keep their slots and only the new one's slot is rewritten.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from llmc.runtime.lora.sites import SLOTS, Site, a_name, b_name
from llmc.runtime.lora.stacks import AdapterWeights, fill_slot, stack_slots


class LoraGraph:
    def __init__(self, session, sites: Sequence[Site], base_inputs: list[str], path: Path):
        """`session`: ONNX Runtime's over the LoRA graph at `path`; `base_inputs`: the base graph's inputs, in order,
        which the LoRA graph must begin with."""
        self.session, self.sites = session, list(sites)
        got = [i.name for i in session.get_inputs()]
        extra = {SLOTS, *(a_name(s) for s in sites), *(b_name(s) for s in sites)}
        if got[:len(base_inputs)] != base_inputs or set(got[len(base_inputs):]) != extra:
            missing = sorted(extra - set(got))[:3]
            raise ValueError(f"{path} is not the base graph with the manifest's LoRA sites: its inputs "
                             f"{'lack ' + ', '.join(missing) if missing else 'differ from the base graph and sites'}")
        self.binding = None  # the runner's: its pools bound as past and present
        self._bound: tuple = ()  # the adapters whose stacks are bound, in slot order
        self._stacks: dict[str, np.ndarray] = {}  # kept alive while bound
        self.num_stackings = 0  # times the step's set of adapters changed and the stacks were rebuilt
        self.num_refills = 0  # times it changed and only the changed slots were rewritten

    def bind(self, adapters: Sequence[AdapterWeights | None], lengths: Sequence[int]) -> None:
        """Bind a step's LoRA inputs: row i brings `lengths[i]` tokens under `adapters[i]` (None: the base)."""
        distinct = {a.ref: a for a in adapters if a is not None}
        if set(distinct) != set(self._bound):
            self._restack(distinct)
        slot = {ref: s for s, ref in enumerate(self._bound)}
        slots = np.repeat(np.array([-1 if a is None else slot[a.ref] for a in adapters], dtype=np.int64),
                          np.asarray(lengths, dtype=np.int64))
        self.binding.bind_cpu_input(SLOTS, slots)

    def _restack(self, distinct: dict) -> None:
        """Stacks for the step's adapters. When as many as before come in at no higher rank, the adapters that stay
        keep their slots and only the slots of those that changed are rewritten (a request for another adapter
        replacing a finished one costs that adapter's copy); otherwise every slot is stacked, in a fixed order."""
        rank = self._stacks[a_name(self.sites[0])].shape[2] // len(self.sites[0].members) if self._stacks else 0
        if len(distinct) == len(self._bound) and max(a.rank for a in distinct.values()) <= rank:
            order = [ref if ref in distinct else None for ref in self._bound]
            incoming = iter(sorted((r for r in distinct if r not in self._bound), key=lambda r: (r.name, r.digest)))
            for s, ref in enumerate(order):
                if ref is None:
                    order[s] = next(incoming)
                    fill_slot(self.sites, self._stacks, s, distinct[order[s]])
            self._bound = tuple(order)
            self.num_refills += 1
        else:
            ordered = sorted(distinct.values(), key=lambda a: (a.ref.name, a.ref.digest))
            self._stacks = stack_slots(self.sites, ordered)
            self._bound = tuple(a.ref for a in ordered)
            self.num_stackings += 1
        for name, value in self._stacks.items():
            self.binding.bind_cpu_input(name, value)

    def close(self) -> None:
        self.session, self.binding, self._stacks, self._bound = None, None, {}, ()
