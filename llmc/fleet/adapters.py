"""LoRA adapters added to and removed from a served model while it serves (`llmc adapters`, the OpenAI frontend's
/v1/load_lora_adapter and /v1/unload_lora_adapter): the repository's store holds the set every replica serves
(runtime/lora/index.py: `<model>/adapters/`, local or S3), and each running replica is told in band
(llmc/client/adapters.py -> runtime/serving/lora_admin.py). A replica started later reads the store's set at load.

    load(store, model, name, folder, urls)   a PEFT adapter converted and checked against the served model's sites
                                             (compiler/lora/convert.py), written to the store (its file, then the
                                             index), then loaded by every replica; no folder: the store's adapter
                                             (or the build's) loaded by the replicas again
    unload(store, model, name, urls, wait)   every replica forgets it (each refuses, or waits, while requests use it),
                                             then the store does; a replica that refuses leaves it in the store
    listing(store, model, urls)              the store's set and each replica's

A bad adapter is refused before anything is written. A replica's refusal is reported with its URL and the model's
message (AdapterUpdateError carries the HTTP status: 400, 404, 409).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from llmc.client.adapters import AdapterControlError, control_sync
from llmc.errors import ServingError
from llmc.runtime.lora.files import AdapterFileError, parse_adapter
from llmc.runtime.lora.index import DIR, INDEX, Entry, file_name, parse_index
from llmc.runtime.manifest import RepositoryManifest


class AdapterUpdateError(ServingError):
    def __init__(self, text: str, status: int = 400):
        super().__init__(text)
        self.status = status


@dataclass
class Served:
    """The served model's LoRA section (its newest version's manifest) and the store's adapter index."""

    store: object
    model: str
    version: int
    manifest: RepositoryManifest
    index: object = field(repr=False)

    @classmethod
    def read(cls, store, model: str | None) -> "Served":
        if model is None:
            models = store.models()
            if len(models) != 1:
                raise AdapterUpdateError(f"{store.url}: name the model (--model): it holds "
                                         f"{', '.join(models) or 'none'}")
            model = models[0]
        versions = store.versions(model)
        if not versions:
            raise AdapterUpdateError(f"{store.url}: no model {model!r} (it holds {', '.join(store.models()) or 'none'})",
                                     404)
        text = store.read(model, f"{versions[-1]}/{RepositoryManifest.filename}")
        manifest = RepositoryManifest.model_validate(json.loads(text or "{}"))
        if manifest.lora is None:
            raise AdapterUpdateError(f"{model}: version {versions[-1]} serves no LoRA adapters (build it with "
                                     f"`adapters:` or a `lora:` section)")
        where = f"{store.url}/{model}/{DIR}/{INDEX}"
        try:
            index = parse_index(store.read(model, f"{DIR}/{INDEX}"), where)
        except ValueError as err:
            raise AdapterUpdateError(str(err)) from None
        return cls(store, model, versions[-1], manifest, index)

    def names(self) -> list[str]:
        built = [a.name for a in self.manifest.lora.adapters if a.name not in self.index.removed]
        return sorted({*built, *self.index.adapters})

    def data(self, name: str) -> bytes:
        """The adapter file served under `name`: the store's, or the build's."""
        entry = self.index.adapters.get(name)
        built = next((a for a in self.manifest.lora.adapters if a.name == name), None)
        if entry is not None:
            found = self.store.read_bytes(self.model, f"{DIR}/{entry.file}")
        elif built is not None and name not in self.index.removed:
            found = self.store.read_bytes(self.model, f"{self.version}/{built.file}")
        else:
            raise AdapterUpdateError(f"lora_name: {self.model} has no adapter {name!r} in {self.store.url} (its "
                                     f"adapters: {', '.join(self.names()) or 'none'})", 404)
        if found is None:
            raise AdapterUpdateError(f"{self.store.url}: the file of adapter {name!r} is missing")
        return found

    def put(self, data: bytes, task_id: int | None) -> Entry:
        """Write an adapter file into the store: the file, then the index naming it (the old file goes last)."""
        try:
            weights = parse_adapter(data, "the adapter file")
        except AdapterFileError as err:
            raise AdapterUpdateError(f"lora_adapter: {err}") from None
        ref, old = weights.ref, self.index.adapters.get(weights.ref.name)
        entry = Entry(ref.name, file_name(ref.name, ref.digest), ref.digest, weights.rank, task_id)
        self.store.write_bytes(self.model, f"{DIR}/{entry.file}", data)
        self.index.adapters[ref.name] = entry
        self.index.removed = [n for n in self.index.removed if n != ref.name]
        self.store.write(self.model, f"{DIR}/{INDEX}", self.index.to_json())
        if old is not None and old.file != entry.file:
            self.store.delete(self.model, f"{DIR}/{old.file}")
        return entry

    def remove(self, name: str) -> None:
        entry = self.index.adapters.pop(name, None)
        if any(a.name == name for a in self.manifest.lora.adapters):
            self.index.removed.append(name)  # the build's adapter: replicas started later skip it
        self.store.write(self.model, f"{DIR}/{INDEX}", self.index.to_json())
        if entry is not None:
            self.store.delete(self.model, f"{DIR}/{entry.file}")


def convert(served: Served, name: str, folder) -> bytes:
    """A PEFT adapter folder as the served model's adapter file (PEFT and torch: the operator's side)."""
    from llmc.compiler.lora.adapter import AdapterError
    from llmc.compiler.lora.convert import convert as to_file
    from llmc.compiler.lora.fold import Fold

    if name == served.model:
        raise AdapterUpdateError(f"lora_name: {name!r} is the model's own name; name the adapter otherwise")
    lora = served.manifest.lora
    fold = None
    if lora.scales_file:  # the base was AWQ scaled: the adapter's arrays take its scales (compiler/lora/fold.py)
        data = served.store.read_bytes(served.model, f"{served.version}/{lora.scales_file}")
        where = f"{served.store.url}/{served.model}/{served.version}/{lora.scales_file}"
        if data is None:
            raise AdapterUpdateError(f"{where}: missing (the manifest names it)")
        try:
            fold = Fold.from_bytes(data, where)
        except ValueError as err:
            raise AdapterUpdateError(str(err)) from None
    try:
        return to_file(name, folder, lora, fold)[0]
    except AdapterError as err:
        raise AdapterUpdateError(f"lora_adapter: {err}") from None


def _each(urls: list[str], model: str, op: dict, data: bytes | None = None, absent_ok: bool = False
          ) -> dict[str, dict]:
    answers = {}
    for url in urls:
        try:
            answers[url] = control_sync(url, model, op, data)
        except AdapterControlError as err:
            if absent_ok and err.status == 404:  # the replica does not serve it: nothing to unload there
                answers[url] = {"absent": str(err)}
                continue
            done = f" ({', '.join(answers)} did)" if answers else ""
            raise AdapterUpdateError(f"{url}: {err}{done}", err.status) from None
        except Exception as err:  # noqa: BLE001 (the server could not be reached: name it)
            raise AdapterUpdateError(f"{url}: cannot reach the server ({err})", 503) from None
    return answers


def load(store, model: str | None, name: str, folder=None, urls: list[str] = (), task_id: int | None = None) -> dict:
    served = Served.read(store, model)
    if folder is not None:
        data = convert(served, name, folder)
        entry = served.put(data, task_id)
    else:
        data = served.data(name)
        if task_id is not None:
            served.put(data, task_id)
        entry = served.index.adapters.get(name)
    answers = _each(list(urls), served.model, {"op": "load", "lora_task_id": task_id}, data)
    digest = entry.digest if entry is not None else parse_adapter(data, name).ref.digest
    return {"model": served.model, "loaded": name, "digest": digest, "replicas": answers}


def unload(store, model: str | None, name: str, urls: list[str] = (), wait: float = 0.0) -> dict:
    served = Served.read(store, model)
    if name not in served.names():
        served.data(name)  # raises: 404 naming the adapters
    answers = _each(list(urls), served.model, {"op": "unload", "name": name, "wait": wait}, absent_ok=True)
    served.remove(name)
    return {"model": served.model, "unloaded": name, "replicas": answers}


def listing(store, model: str | None, urls: list[str] = ()) -> dict:
    served = Served.read(store, model)
    return {"model": served.model, "store": served.names(),
            "replicas": {url: [a["name"] for a in answer["adapters"]]
                         for url, answer in _each(list(urls), served.model, {"op": "list"}).items()}}
