"""An adapter's file in a model repository: its per-site arrays (stacks.py) in the safetensors format, with its
identity in the header's metadata. Written by the build (compiler/lora/package.py) and by `llmc adapters load`
(llmc/fleet/adapters.py), read by the adapter store, and sent whole to a running model to load it
(runtime/serving/lora_admin.py).

The format (safetensors' own: an 8-byte little-endian header length, a JSON header naming each tensor's dtype, shape
and byte range, then the bytes) is written and read here with NumPy: the serving Python has no safetensors package,
and an adapter's file is a few dozen tensors.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from llmc.runtime.lora.stacks import AdapterRef, AdapterWeights

FORMAT = "llmc-lora-sites/1"


class AdapterFileError(RuntimeError):
    """An adapter file the store cannot serve: unreadable, another format, or not the adapter the manifest names."""


def adapter_bytes(weights: AdapterWeights) -> bytes:
    """`weights` as an adapter file's bytes."""
    tensors = {f"{site}.{which}": array for site, pair in sorted(weights.sites.items())
               for which, array in zip("ab", pair)}
    header: dict = {"__metadata__": {"format": FORMAT, "name": weights.ref.name, "digest": weights.ref.digest,
                                     "rank": str(weights.rank)}}
    at = 0
    for name, array in tensors.items():
        assert array.dtype == np.float32 and array.flags.c_contiguous, name
        header[name] = {"dtype": "F32", "shape": list(array.shape), "data_offsets": [at, at + array.nbytes]}
        at += array.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return b"".join([struct.pack("<Q", len(text)), text, *(array.tobytes() for array in tensors.values())])


def write_adapter_file(path: Path, weights: AdapterWeights) -> None:
    Path(path).write_bytes(adapter_bytes(weights))


def _header(data: bytes | memoryview, source: str) -> tuple[dict, dict, int]:
    """(metadata, tensor entries, where the data starts) of an adapter file's bytes; AdapterFileError otherwise."""
    try:
        (size,) = struct.unpack("<Q", bytes(data[:8]))
        header = json.loads(bytes(data[8:8 + size]))
        meta = header.pop("__metadata__", {})
    except (ValueError, struct.error, AttributeError) as err:
        raise AdapterFileError(f"{source} is not a readable adapter file ({err})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise AdapterFileError(f"{source} is not an llmc adapter file (format "
                               f"{meta.get('format') if isinstance(meta, dict) else None!r}, expected {FORMAT!r}; "
                               f"`llmc adapters load` converts a PEFT adapter)")
    for key in ("name", "digest", "rank"):
        if not isinstance(meta.get(key), str) or not meta[key]:
            raise AdapterFileError(f"{source}: the header's metadata has no {key}")
    return meta, header, 8 + size


def read_header(path: Path) -> tuple[AdapterRef, int, dict[str, tuple[tuple, tuple]]]:
    """(identity, rank, site -> (a's shape, b's shape)) of the adapter file at `path`, reading its header only."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            size = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
            data = head + f.read(min(size, 1 << 24))
    except OSError as err:
        raise AdapterFileError(f"{path} is not a readable adapter file ({err})") from None
    meta, header, _ = _header(data, str(path))
    return AdapterRef(meta["name"], meta["digest"]), _rank(meta, str(path)), _shapes(header, str(path))


def parse_adapter(data: bytes | memoryview, source: str) -> AdapterWeights:
    """The adapter an adapter file's bytes hold (its identity from the header); AdapterFileError when they are not
    one. `source` names the bytes in messages."""
    meta, header, start = _header(data, source)
    shapes = _shapes(header, source)
    body = memoryview(data)[start:]
    arrays = {}
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        if entry.get("dtype") != "F32" or not 0 <= begin <= end <= len(body) or \
                end - begin != 4 * int(np.prod(entry["shape"])):
            raise AdapterFileError(f"{source}: tensor {name} is not {entry.get('shape')} F32 within the file "
                                   f"(a truncated or damaged file)")
        arrays[name] = np.frombuffer(body[begin:end], dtype=np.float32).reshape(entry["shape"])
    sites = {site: (arrays[f"{site}.a"], arrays[f"{site}.b"]) for site in shapes}
    return AdapterWeights(AdapterRef(meta["name"], meta["digest"]), _rank(meta, source), sites)


def _rank(meta: dict, source: str) -> int:
    try:
        return int(meta["rank"])
    except ValueError:
        raise AdapterFileError(f"{source}: the header's rank {meta['rank']!r} is not a number") from None


def _shapes(header: dict, source: str) -> dict[str, tuple[tuple, tuple]]:
    """site -> (a's shape, b's shape); every tensor is a site's a or b, and each site has both."""
    sites: dict[str, dict[str, tuple]] = {}
    for name, entry in header.items():
        site, _, which = name.rpartition(".")
        if which not in ("a", "b") or not site or not isinstance(entry, dict) or "shape" not in entry:
            raise AdapterFileError(f"{source}: tensor {name!r} is not a site's a or b")
        sites.setdefault(site, {})[which] = tuple(entry["shape"])
    lacking = sorted(f"{site}.{w}" for site, pair in sites.items() for w in "ab" if w not in pair)
    if lacking:
        raise AdapterFileError(f"{source}: missing tensor {', '.join(lacking)}")
    return {site: (pair["a"], pair["b"]) for site, pair in sites.items()}


def read_adapter_file(ref: AdapterRef, path: Path) -> AdapterWeights:
    """The adapter in `path`, refused unless it is `ref` (its name and digest)."""
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise AdapterFileError(f"adapter {ref.name!r}: {path} is not a readable adapter file ({err})") from None
    try:
        weights = parse_adapter(data, str(path))
    except AdapterFileError as err:
        raise AdapterFileError(f"adapter {ref.name!r}: {err}") from None
    if weights.ref != ref:
        raise AdapterFileError(f"adapter {ref.name!r}: {path} holds adapter {weights.ref.name!r} with digest "
                               f"{weights.ref.digest[:12]}, not the manifest's {ref.digest[:12]}")
    return weights
