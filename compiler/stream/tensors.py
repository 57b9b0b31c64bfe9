"""A checkpoint's tensors, one at a time: what a streamed build reads instead of a loaded model.

`CheckpointTensors` is the one interface: the checkpoint's tensor names (as transformers' loader sees them
before its renames and conversions), and one tensor by name, in its stored dtype, read from a memory map
so that only that tensor's pages are touched. Safetensors shards are read here (`safetensors.safe_open`);
a GGUF file by gguf_tensors.py (dequantized one tensor at a time, as transformers would name it).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Protocol

from llmc.errors import SourceError

# a checkpoint name's layer: the index after the decoder's layer container (`model.layers.3.mlp...`,
# `transformer.h.3.attn...`, `language_model.model.layers.3...`); experts' own indices come later in the name
_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks|block)\.(\d+)\.")


class CheckpointTensors(Protocol):
    def keys(self) -> list[str]:
        """Every tensor's name, as transformers' loader receives it."""

    def load(self, key: str):
        """The tensor `key` (a torch.Tensor), in its stored dtype (GGUF: dequantized to float32)."""


def layer_of(key: str) -> int | None:
    """The decoder layer a checkpoint tensor belongs to; None for what every layer shares (embeddings,
    final norm, LM head)."""
    match = _LAYER.search(key)
    return int(match[1]) if match else None


class SafetensorsTensors:
    """The tensors of a checkpoint's safetensors shards, each read from its file's memory map on demand. A shard is
    mapped only while a tensor is read from it: a map kept open keeps every page read so far in the process's
    resident set (clean pages the kernel could drop, yet counted), so the resident set grew with the layers read
    (16 layers of hidden 2048: 3.8 GiB, of which 2.2 GiB the shards' pages)."""

    def __init__(self, files: tuple[Path, ...] | list[Path]):
        self._files, self._where = list(files), {}
        for index, path in enumerate(self._files):
            with self._open(index) as handle:
                for key in handle.keys():
                    if key in self._where:
                        raise SourceError(f"{path}: tensor {key} is also in {self._files[self._where[key]].name}")
                    self._where[key] = index

    def _open(self, index: int):
        from safetensors import safe_open

        try:
            return safe_open(str(self._files[index]), framework="pt")
        except Exception as err:
            raise SourceError(f"{self._files[index]}: not a readable safetensors file ({err})") from None

    def keys(self) -> list[str]:
        return list(self._where)

    def load(self, key: str):
        index = self._where[key]
        try:
            with self._open(index) as handle:
                return handle.get_tensor(key)
        except SourceError:
            raise
        except Exception as err:
            raise SourceError(f"{self._files[index]}: could not read tensor {key} ({err})") from None


def checkpoint_tensors(info) -> CheckpointTensors:
    """The tensors of a found source (source.SourceInfo): its safetensors shards, or its GGUF file."""
    if info.kind == "gguf":
        from llmc.compiler.stream.gguf_tensors import GGUFTensors

        return GGUFTensors(info.path)
    if info.uses_pickle:
        raise SourceError(f"{info.path}: pickle weights cannot be read a tensor at a time; convert them to "
                          "safetensors to build layer by layer")
    return SafetensorsTensors(info.weight_files)
