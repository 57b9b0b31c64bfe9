"""An adapter's file in a model repository: its per-site arrays (stacks.py) in the safetensors format, with its
identity in the header's metadata. Written by the build (compiler/lora/package.py), read by the adapter store.

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


def write_adapter_file(path: Path, weights: AdapterWeights) -> None:
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
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for array in tensors.values():
            f.write(array.tobytes())


def read_adapter_file(ref: AdapterRef, path: Path) -> AdapterWeights:
    """The adapter in `path`, refused unless it is `ref` (its name and digest)."""
    try:
        data = Path(path).read_bytes()
        (size,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + size])
    except (OSError, ValueError, struct.error) as err:
        raise AdapterFileError(f"adapter {ref.name!r}: {path} is not a readable adapter file ({err})") from None
    meta = header.pop("__metadata__", {})
    if meta.get("format") != FORMAT:
        raise AdapterFileError(f"adapter {ref.name!r}: {path} is not an llmc adapter file (format "
                               f"{meta.get('format')!r}, expected {FORMAT!r})")
    if (meta.get("name"), meta.get("digest")) != (ref.name, ref.digest):
        raise AdapterFileError(f"adapter {ref.name!r}: {path} holds adapter {meta.get('name')!r} with digest "
                               f"{str(meta.get('digest'))[:12]}, not the manifest's {ref.digest[:12]}")
    body = memoryview(data)[8 + size:]
    arrays = {}
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        arrays[name] = np.frombuffer(body[begin:end], dtype=np.float32).reshape(entry["shape"])
    sites = {name[:-2]: (arrays[name], arrays[name[:-2] + ".b"]) for name in arrays if name.endswith(".a")}
    return AdapterWeights(ref, int(meta["rank"]), sites)
