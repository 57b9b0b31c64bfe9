"""The adapters a served model knows, and those held in host memory: an LRU of at most `capacity` adapters
(lora.max_host_adapters) with reference counts, feeding the slots of the steps (runtime/engine/lora_slots.py).

    resolve(name) -> AdapterRef      a request's adapter, by name (UnknownAdapter: nothing runs)
    can_pin(ref) / pin(ref)          a running request holds its adapter's weights: loaded from its file when not
                                     in memory, evicting the least recently released adapter no request holds
    unpin(ref)                       the request is done with it (finished, cancelled or preempted)
    unload(name)                     forget an adapter: refused, naming how many requests hold it, while any does

An adapter held by a request is never evicted, nor unloaded under it. When every adapter in memory is held, a new
one cannot be pinned (`can_pin` is False) and its requests wait; the scheduler admits no more distinct adapters a
step than there are slots, which capacity is at least (compiler/spec/adapters.py).
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Callable

from llmc.runtime.lora.files import read_adapter_file
from llmc.runtime.lora.stacks import AdapterRef, AdapterWeights


class UnknownAdapter(ValueError):
    """A request names an adapter the model does not serve; the message names the field and the adapters served."""


class AdapterInUse(RuntimeError):
    """An adapter held by running requests cannot be unloaded now."""


class AdapterStore:
    def __init__(self, capacity: int, load: Callable[[AdapterRef, Path], AdapterWeights] = read_adapter_file):
        if capacity < 1:
            raise ValueError(f"capacity ({capacity}) must be at least 1 (lora.max_host_adapters)")
        self.capacity, self._load = capacity, load
        self._catalog: dict[str, tuple[AdapterRef, Path]] = {}
        self._resident: OrderedDict[AdapterRef, AdapterWeights] = OrderedDict()  # least recently released first
        self._pins: dict[AdapterRef, int] = {}
        self.num_loads = 0  # adapters read from their files since start

    def register(self, ref: AdapterRef, path: Path) -> None:
        """Serve `ref` from `path` under its name (the manifest's adapters, at load)."""
        if ref.name in self._catalog:
            raise ValueError(f"adapter {ref.name!r} is registered already")
        self._catalog[ref.name] = (ref, Path(path))

    @property
    def names(self) -> list[str]:
        return sorted(self._catalog)

    def resolve(self, name: str) -> AdapterRef:
        found = self._catalog.get(name)
        if found is None:
            served = ", ".join(self.names) or "none"
            raise UnknownAdapter(f"lora_name: this model serves no adapter {name!r} (its adapters: {served})")
        return found[0]

    def pins(self, ref: AdapterRef) -> int:
        return self._pins.get(ref, 0)

    @property
    def resident(self) -> list[AdapterRef]:
        return list(self._resident)

    def can_pin(self, ref: AdapterRef) -> bool:
        return ref in self._resident or len(self._resident) < self.capacity or \
            any(not self._pins.get(r) for r in self._resident)

    def pin(self, ref: AdapterRef) -> AdapterWeights:
        """`ref`'s weights, held until `unpin`; loaded (evicting an unheld adapter) when not in memory."""
        weights = self._resident.get(ref)
        if weights is None:
            if not self.can_pin(ref):
                raise RuntimeError(f"adapter {ref.name!r}: all {self.capacity} adapters in host memory are held by "
                                   f"running requests (lora.max_host_adapters)")
            _, path = self._catalog[ref.name]
            weights = self._load(ref, path)
            self.num_loads += 1
            while len(self._resident) >= self.capacity:
                self._evict_one()
            self._resident[ref] = weights
        self._pins[ref] = self._pins.get(ref, 0) + 1
        self._resident.move_to_end(ref)
        return weights

    def unpin(self, ref: AdapterRef) -> None:
        count = self._pins.get(ref, 0)
        assert count > 0, f"adapter {ref.name!r} unpinned more often than pinned"
        if count == 1:
            del self._pins[ref]
        else:
            self._pins[ref] = count - 1
        self._resident.move_to_end(ref)

    def unload(self, name: str) -> None:
        """Forget the adapter `name` (its weights leave memory); refused while running requests hold it."""
        ref = self.resolve(name)
        if self._pins.get(ref):
            raise AdapterInUse(f"adapter {name!r}: {self._pins[ref]} running request(s) use it; it is unloaded once "
                               f"they finish (retry then)")
        del self._catalog[name]
        self._resident.pop(ref, None)

    def _evict_one(self) -> None:
        victim = next(r for r in self._resident if not self._pins.get(r))
        del self._resident[victim]
