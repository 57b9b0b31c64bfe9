"""The adapters of a model repository's store, beside its versions: what every replica serves on top of the adapters
its version was built with, so a replica started later sees the adapters loaded while the others served.

    <model>/adapters/index.json                      {"format": INDEX_FORMAT, "adapters": {name: entry}, "removed": [names]}
    <model>/adapters/<name>-<digest[:16]>.safetensors the adapter (files.py), a new file for new weights

An entry is {"file", "digest", "rank", "lora_task_id" (or null)}. `removed` names adapters of the version's build
that were unloaded, so a replica starting later does not serve them either. Written by `llmc adapters`
(llmc/fleet/adapters.py: the file first, the index last); read here when a model version is loaded
(runtime/serving/loader.py), from the copy Triton made of the model's folder (local or S3 alike).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

DIR = "adapters"  # in the model's folder, beside the version folders
INDEX = "index.json"
INDEX_FORMAT = "llmc-lora-index/1"


@dataclass(frozen=True)
class Entry:
    name: str
    file: str  # in DIR
    digest: str
    rank: int
    lora_task_id: int | None = None


@dataclass
class Index:
    adapters: dict[str, Entry]
    removed: list[str]

    def to_json(self) -> str:
        return json.dumps({"format": INDEX_FORMAT, "removed": sorted(set(self.removed)),
                           "adapters": {n: {"file": e.file, "digest": e.digest, "rank": e.rank,
                                            "lora_task_id": e.lora_task_id} for n, e in sorted(self.adapters.items())}},
                          indent=1)


def file_name(name: str, digest: str) -> str:
    return f"{name}-{digest[:16]}.safetensors"


def parse_index(text: str | None, where: str) -> Index:
    """The index's text (None: no index yet, an empty one); ValueError naming `where` when it is not one."""
    if text is None:
        return Index({}, [])
    try:
        data = json.loads(text)
        if data.get("format") != INDEX_FORMAT:
            raise ValueError(f"format {data.get('format')!r}, expected {INDEX_FORMAT!r}")
        adapters = {name: Entry(name, e["file"], e["digest"], int(e["rank"]), e.get("lora_task_id"))
                    for name, e in data["adapters"].items()}
        return Index(adapters, [str(n) for n in data.get("removed", [])])
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{where}: not an adapter index ({err})") from None


def read_index(model_dir: Path) -> Index:
    path = Path(model_dir) / DIR / INDEX
    return parse_index(path.read_text() if path.is_file() else None, str(path))
