"""LoRA adapters loaded and unloaded while a model serves (docs/lora.md), as control requests through the serving
loop (loop.py): a request carrying `lora_control`, JSON, and for a load the adapter file's bytes in `lora_adapter`
(tensors.py). `llmc adapters` and the OpenAI frontend send them to every replica (llmc/fleet/adapters.py), after
writing the adapter into the repository's store, where replicas started later read it (loader.py).

    {"op": "load", "lora_task_id": N?}       check the adapter (runtime/lora/check.py), keep its file in this model's
                                             scratch folder, serve it (warm: its weights stay in host memory, and go
                                             into a slot when the loop next idles). The same name with the same
                                             digest: nothing changes; another digest: the new weights replace the
                                             old ones, refused while requests use the old
    {"op": "unload", "name": X, "wait": S}   forget it; while requests use it: refused at once (wait 0), or no new
                                             request takes it and it goes when they end, within S seconds
    {"op": "list"}                           the adapters served and the limits

The answer is one response, JSON in `text_output`, or an error whose message names what is wrong: `lora_adapter:`
(a refused adapter: 400), `lora_name:` (an unknown adapter: 404), `in use:` (409), `lora_control:` (400). A refused
load leaves nothing behind. An adapter's identity is its name and digest, so a reload under the same name with other
weights keys its prefix-cache blocks apart from the old ones (runtime/engine/prefix_keys.py).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Mapping

import numpy as np

from llmc.runtime.lora.check import AdapterRefused, check_weights
from llmc.runtime.lora.files import AdapterFileError, parse_adapter
from llmc.runtime.lora.index import file_name
from llmc.runtime.lora.store import AdapterInUse, UnknownAdapter
from llmc.runtime.serving.tensors import LORA_ADAPTER, LORA_CONTROL

MAX_WAIT = 600.0  # seconds an unload may wait for the requests using its adapter
WAIT_POLL = 0.02


class ControlError(ValueError):
    """A control request refused; the message starts with the field (or `in use:`) the frontend maps to a status."""


def is_control(inputs: Mapping[str, np.ndarray]) -> bool:
    return LORA_CONTROL in inputs


class LoraAdmin:
    def __init__(self, engine, lock: threading.Lock):
        """`engine`: a paged or slot engine serving adapters (engine.lora); `lock`: the loop's, held while requests are
        queued, so a request never resolves an adapter an unload is taking away."""
        self.engine, self.lock = engine, lock
        self._scratch: Path | None = None  # this model's copies of the adapters loaded at run time

    @property
    def store(self):
        return self.engine.lora.store

    def adapter_of(self, request) -> str | None:
        """The adapter a request runs under: `lora_name`, or the adapter loaded with its `lora_task_id`."""
        if request.lora_task_id is None:
            return request.lora_name
        if getattr(self.engine, "lora", None) is None:
            raise UnknownAdapter(f"lora_task_id: this model serves no LoRA adapters (got {request.lora_task_id})")
        name = self.store.by_task(request.lora_task_id)
        if request.lora_name is not None and request.lora_name != name:
            raise UnknownAdapter(f"lora_task_id: {request.lora_task_id} is adapter {name!r}, not lora_name "
                                 f"{request.lora_name!r}")
        return name

    def handle(self, inputs: Mapping[str, np.ndarray], answer: Callable[[dict | None, str | None], None]) -> None:
        """Run a control request; `answer(result, None)` or `answer(None, message)` (once, maybe from a thread)."""
        try:
            op = _op(inputs)
            if getattr(self.engine, "lora", None) is None:
                raise ControlError("lora_control: this model serves no LoRA adapters (build it with `adapters:` or "
                                   "a `lora:` section to load them at run time)")
            kind = op.get("op")
            if kind == "list":
                answer(self.listing(), None)
            elif kind == "load":
                answer(self.load(_adapter_bytes(inputs), op.get("lora_task_id")), None)
            elif kind == "unload":
                self.unload(str(op.get("name") or ""), float(op.get("wait") or 0), answer)
            else:
                raise ControlError(f"lora_control: op {kind!r} is not one of load, unload, list")
        except (ControlError, UnknownAdapter) as err:
            answer(None, str(err))
        except (TypeError, ValueError) as err:
            answer(None, f"lora_control: {err}")

    def listing(self) -> dict:
        lora = self.engine.lora
        return {"adapters": self.store.describe(), "max_slots": lora.max_slots,
                "max_host_adapters": self.store.capacity, "max_rank": lora.max_rank}

    def load(self, data: bytes, task_id) -> dict:
        start = time.perf_counter()
        if task_id is not None and (not isinstance(task_id, int) or task_id < 0):
            raise ControlError(f"lora_control: lora_task_id must be a whole number >= 0 (got {task_id!r})")
        try:
            weights = parse_adapter(data, "the adapter file")
            check_weights(weights, self.engine.runner.lora.sites, self.engine.lora.max_rank)
        except (AdapterFileError, AdapterRefused) as err:
            raise ControlError(f"lora_adapter: {err}") from None
        ref = weights.ref
        path = self._scratch_dir() / file_name(ref.name, ref.digest)
        with self.lock:
            current = self.store.describe()
            served = next((a for a in current if a["name"] == ref.name), None)
            if served is not None and served["digest"] == ref.digest and served["lora_task_id"] == task_id:
                return {"loaded": ref.name, "digest": ref.digest, "rank": weights.rank, "unchanged": True,
                        "seconds": time.perf_counter() - start}
            running, queued = self.engine.adapter_users(ref.name) if served is not None else (0, 0)
            if running or queued:
                raise ControlError(f"in use: adapter {ref.name!r}: {running} running and {queued} queued request(s) "
                                   f"use the weights served under this name; not replaced (unload it with a wait, "
                                   f"then load)")
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)
            try:
                old = self.store.replace(ref, path, weights, task_id)
            except (ValueError, AdapterInUse) as err:
                path.unlink(missing_ok=True)
                raise ControlError(f"lora_control: {err}" if not isinstance(err, AdapterInUse) else f"in use: {err}")
            self._forget(old, keep=path)
            self.engine.lora.loaded(ref)  # into a slot when the engine next has no work: its first request finds it
        return {"loaded": ref.name, "digest": ref.digest, "rank": weights.rank, "lora_task_id": task_id,
                "replaced": old.digest if old is not None and old != ref else None,
                "seconds": time.perf_counter() - start}

    def unload(self, name: str, wait: float, answer) -> None:
        if not name:
            raise ControlError("lora_control: unload names the adapter (\"name\")")
        if not 0 <= wait <= MAX_WAIT:
            raise ControlError(f"lora_control: wait must be between 0 and {MAX_WAIT:.0f} seconds (got {wait})")
        with self.lock:
            self.store.resolve(name)  # an unknown adapter: UnknownAdapter, naming those served
            done = self._try_unload(name)
            if done is None and wait:
                self.store.drain(name)  # no new request takes it meanwhile
        if done is not None:
            answer(done, None)
        elif not wait:
            running, queued = self.engine.adapter_users(name)
            answer(None, f"in use: adapter {name!r}: {running} running and {queued} queued request(s) use it; not "
                         f"unloaded (refused at once: unload with a wait to let them finish)")
        else:
            threading.Thread(target=self._wait_unload, args=(name, wait, answer), daemon=True,
                             name="llmc-lora-unload").start()

    def _wait_unload(self, name: str, wait: float, answer) -> None:
        start = time.monotonic()
        while time.monotonic() - start < wait:
            with self.lock:
                done = self._try_unload(name)
            if done is not None:
                answer({**done, "waited": round(time.monotonic() - start, 3)}, None)
                return
            time.sleep(WAIT_POLL)
        with self.lock:
            self.store.undrain(name)
            running, queued = self.engine.adapter_users(name)
        answer(None, f"in use: adapter {name!r}: still {running} running and {queued} queued request(s) after "
                     f"waiting {wait:g} s; not unloaded, and it takes requests again")

    def _try_unload(self, name: str) -> dict | None:
        """Unload `name` when no request uses it (call under the lock): its answer, or None."""
        if any(self.engine.adapter_users(name)):
            return None
        try:
            ref = self.store.unload(name)
        except AdapterInUse:
            return None
        self._forget(ref)
        return {"unloaded": name, "digest": ref.digest}

    def _forget(self, ref, keep: Path | None = None) -> None:
        """Delete the scratch copy of an adapter no longer served (the build's and the store's files stay)."""
        if ref is not None and self._scratch is not None:
            path = self._scratch / file_name(ref.name, ref.digest)
            if path != keep:
                path.unlink(missing_ok=True)

    def _scratch_dir(self) -> Path:
        if self._scratch is None:
            self._scratch = Path(tempfile.mkdtemp(prefix="llmc-lora-"))
        return self._scratch

    def close(self) -> None:
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)


def _op(inputs: Mapping[str, np.ndarray]) -> dict:
    array = np.asarray(inputs[LORA_CONTROL])
    if array.size != 1:
        raise ControlError(f"lora_control: expected one JSON value, got shape {list(array.shape)}")
    raw = array.reshape(()).item()
    try:
        op = json.loads(raw if isinstance(raw, (bytes, str)) else bytes(raw))
    except ValueError as err:
        raise ControlError(f"lora_control: not JSON ({err})") from None
    if not isinstance(op, dict):
        raise ControlError("lora_control: expected a JSON object {\"op\": ...}")
    return op


def _adapter_bytes(inputs: Mapping[str, np.ndarray]) -> bytes:
    if LORA_ADAPTER not in inputs:
        raise ControlError(f"{LORA_ADAPTER}: a load carries the adapter file's bytes (llmc adapters load converts a "
                           f"PEFT adapter)")
    array = np.asarray(inputs[LORA_ADAPTER])
    if array.size != 1:
        raise ControlError(f"{LORA_ADAPTER}: expected one BYTES value, got shape {list(array.shape)}")
    raw = array.reshape(()).item()
    return raw if isinstance(raw, bytes) else bytes(raw)
