"""The adapters a served model knows, and those held in host memory: an LRU of at most `capacity` adapters
(lora.max_host_adapters) with reference counts, feeding the slots of the steps (runtime/engine/lora_slots.py).

    resolve(name) -> AdapterRef      a request's adapter, by name (UnknownAdapter: nothing runs)
    by_task(task_id) -> name         TensorRT-LLM's lora_task_id of an adapter loaded with one
    can_pin(ref) / pin(ref)          a running request holds its adapter's weights: loaded from its file when not
                                     in memory, evicting the least recently released adapter no request holds
    unpin(ref)                       the request is done with it (finished, cancelled or preempted)
    register(ref, path, ...)         serve an adapter (the manifest's, the store's, one loaded at run time)
    replace(ref, path, ...)          serve other weights under a name already served (a reload)
    unload(name)                     forget an adapter: refused, naming how many requests hold it, while any does
    drain(name) / undrain(name)      refuse new requests for an adapter waiting to be unloaded

An adapter held by a request is never evicted, nor unloaded under it. When every adapter in memory is held, a new
one cannot be pinned (`can_pin` is False) and its requests wait; the scheduler admits no more distinct adapters a
step than there are slots, which capacity is at least (compiler/spec/adapters.py).

The engine's thread pins and unpins while a request thread registers and unloads (runtime/serving/lora_admin.py):
every call takes the store's lock.
"""

from __future__ import annotations

import threading
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
        self._catalog: dict[str, AdapterRef] = {}
        self._files: dict[AdapterRef, Path] = {}
        self._tasks: dict[int, str] = {}  # lora_task_id -> name
        self._draining: set[str] = set()
        self._resident: OrderedDict[AdapterRef, AdapterWeights] = OrderedDict()  # least recently released first
        self._pins: dict[AdapterRef, int] = {}
        self._lock = threading.RLock()
        self.num_loads = 0  # adapters read from their files since start

    def register(self, ref: AdapterRef, path: Path, weights: AdapterWeights | None = None,
                 task_id: int | None = None) -> None:
        """Serve `ref` from `path` under its name; `weights`: already read (kept in memory when there is room);
        `task_id`: the lora_task_id requests may name it by."""
        with self._lock:
            if ref.name in self._catalog:
                raise ValueError(f"adapter {ref.name!r} is registered already")
            owner = self._tasks.get(task_id) if task_id is not None else None
            if owner is not None:
                raise ValueError(f"lora_task_id: {task_id} is adapter {owner!r}'s already")
            self._catalog[ref.name], self._files[ref] = ref, Path(path)
            if task_id is not None:
                self._tasks[task_id] = ref.name
            if weights is not None and ref not in self._resident and self._room():
                self._make_room()
                self._resident[ref] = weights

    def replace(self, ref: AdapterRef, path: Path, weights: AdapterWeights | None = None,
                task_id: int | None = None) -> AdapterRef | None:
        """Serve `ref` under its name in place of the adapter served under it (if any, returned), which is unloaded
        (refused while requests hold it)."""
        with self._lock:
            old = self._catalog.get(ref.name)
            if old is not None:
                self.unload(ref.name)
            self.register(ref, path, weights, task_id)
            return old

    @property
    def names(self) -> list[str]:
        return sorted(self._catalog)

    def task_of(self, name: str) -> int | None:
        return next((task for task, owner in self._tasks.items() if owner == name), None)

    def resolve(self, name: str) -> AdapterRef:
        with self._lock:
            found = self._catalog.get(name)
            if found is None:
                served = ", ".join(self.names) or "none"
                raise UnknownAdapter(f"lora_name: this model serves no adapter {name!r} (its adapters: {served})")
            if name in self._draining:
                raise UnknownAdapter(f"lora_name: adapter {name!r} is being unloaded; it takes no new requests")
            return found

    def by_task(self, task_id: int) -> str:
        with self._lock:
            name = self._tasks.get(task_id)
            if name is None:
                known = ", ".join(f"{t} ({n})" for t, n in sorted(self._tasks.items())) or "none"
                raise UnknownAdapter(f"lora_task_id: no adapter is loaded with task id {task_id} (loaded: {known}); "
                                     f"load it first (llmc adapters load --task-id)")
            return name

    def pins(self, ref: AdapterRef) -> int:
        return self._pins.get(ref, 0)

    @property
    def resident(self) -> list[AdapterRef]:
        return list(self._resident)

    def _room(self) -> bool:
        return len(self._resident) < self.capacity or any(not self._pins.get(r) for r in self._resident)

    def can_pin(self, ref: AdapterRef) -> bool:
        with self._lock:
            return ref in self._resident or self._room()

    def pin(self, ref: AdapterRef) -> AdapterWeights:
        """`ref`'s weights, held until `unpin`; loaded (evicting an unheld adapter) when not in memory."""
        with self._lock:
            weights = self._resident.get(ref)
            if weights is None:
                if not self._room():
                    raise RuntimeError(f"adapter {ref.name!r}: all {self.capacity} adapters in host memory are held "
                                       f"by running requests (lora.max_host_adapters)")
                path = self._files.get(ref)
                if path is None:
                    raise UnknownAdapter(f"lora_name: adapter {ref.name!r} (digest {ref.digest[:12]}) was unloaded")
                weights = self._load(ref, path)
                self.num_loads += 1
                self._make_room()
                self._resident[ref] = weights
            self._pins[ref] = self._pins.get(ref, 0) + 1
            self._resident.move_to_end(ref)
            return weights

    def unpin(self, ref: AdapterRef) -> None:
        with self._lock:
            count = self._pins.get(ref, 0)
            assert count > 0, f"adapter {ref.name!r} unpinned more often than pinned"
            if count == 1:
                del self._pins[ref]
            else:
                self._pins[ref] = count - 1
            self._resident.move_to_end(ref)

    def unload(self, name: str) -> AdapterRef:
        """Forget the adapter `name` (its weights leave memory); refused while running requests hold it."""
        with self._lock:
            ref = self._catalog.get(name)
            if ref is None:
                self.resolve(name)  # raises, naming the adapters served
            if self._pins.get(ref):
                raise AdapterInUse(f"adapter {name!r}: {self._pins[ref]} running request(s) use it; it is unloaded "
                                   f"once they finish (retry then, or unload with a wait)")
            del self._catalog[name]
            self._files.pop(ref, None)
            self._resident.pop(ref, None)
            self._draining.discard(name)
            self._tasks = {t: n for t, n in self._tasks.items() if n != name}
            return ref

    def drain(self, name: str) -> None:
        with self._lock:
            self.resolve(name)
            self._draining.add(name)

    def undrain(self, name: str) -> None:
        with self._lock:
            self._draining.discard(name)

    def describe(self) -> list[dict]:
        """Each adapter served: name, digest, its task id, whether it is in host memory and how many requests hold it."""
        with self._lock:
            return [{"name": name, "digest": ref.digest, "lora_task_id": self.task_of(name),
                     "resident": ref in self._resident, "running": self._pins.get(ref, 0),
                     "draining": name in self._draining} for name, ref in sorted(self._catalog.items())]

    def _make_room(self) -> None:
        """Evict the least recently released adapters no request holds until one more fits (call when `_room()`)."""
        while len(self._resident) >= self.capacity:
            victim = next(r for r in self._resident if not self._pins.get(r))
            del self._resident[victim]
