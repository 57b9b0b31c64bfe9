"""The LoRA graph of a paged runner (runtime/runners/paged.py): a second session over the same block pools, run for a
step when any of its tokens has an adapter (a step with none runs the base graph, at the base graph's cost).

The LoRA graph is the base graph with a branch beside each projection (compiler/lora/graph.py), naming the base
graph's weights file: its extra inputs are `lora_slots` and each site's A and B stacks (runtime/lora/sites.py). A step
binds the distinct adapters its rows use, one slot each in a fixed order (name, then digest), padded to the highest
rank among them. Stacking copies every site's A and B (tens of MB for a 135M model at rank 16), so the stacks bound
are kept and rebound only when the step's set of adapters changes: steady decoding over the same requests binds
only `lora_slots`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from llmc.runtime.lora.sites import SLOTS, Site, a_name, b_name
from llmc.runtime.lora.stacks import AdapterWeights, stack_slots


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

    def bind(self, adapters: Sequence[AdapterWeights | None], lengths: Sequence[int]) -> None:
        """Bind a step's LoRA inputs: row i brings `lengths[i]` tokens under `adapters[i]` (None: the base)."""
        distinct = sorted({a.ref: a for a in adapters if a is not None}.values(),
                          key=lambda a: (a.ref.name, a.ref.digest))
        refs = tuple(a.ref for a in distinct)
        if refs != self._bound:
            self._stacks = stack_slots(self.sites, distinct)
            for name, value in self._stacks.items():
                self.binding.bind_cpu_input(name, value)
            self._bound = refs
            self.num_stackings += 1
        slot = {ref: s for s, ref in enumerate(refs)}
        slots = np.repeat(np.array([-1 if a is None else slot[a.ref] for a in adapters], dtype=np.int64),
                          np.asarray(lengths, dtype=np.int64))
        self.binding.bind_cpu_input(SLOTS, slots)

    def close(self) -> None:
        self.session, self.binding, self._stacks, self._bound = None, None, {}, ()
