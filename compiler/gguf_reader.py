"""One parse of a GGUF file per process: transformers' GGUF loaders take a path, not a reader, and parse the
file anew for the config, the weights and the tokenizer."""

from __future__ import annotations

import functools
import os
from contextlib import contextmanager
from typing import Iterator


@functools.lru_cache(maxsize=1)
def _parsed(path: str, size: int, mtime_ns: int):
    from gguf.gguf_reader import GGUFReader  # the class itself: `gguf.GGUFReader` is what one_parse replaces

    return GGUFReader(path)


@contextmanager
def one_parse() -> Iterator[None]:
    """Inside, `gguf.GGUFReader(path)` returns the one reader of that file this process parsed (the last file
    read; parsed again when it changed on disk). transformers' loaders parse the file anew for the config, the
    weights and the tokenizer: a parse walks every metadata part in Python (~7 s for SmolLM2's 49,152-token
    vocabulary, longer for larger ones), and a build reads a source several times. Written by hand: transformers takes
    no reader. The reader is read-only (a memory map), so sharing it changes nothing loaded."""
    import gguf
    from gguf.gguf_reader import GGUFReader

    def shared(path, mode: str = "r"):
        if mode != "r":
            return GGUFReader(path, mode)
        stat = os.stat(path)
        return _parsed(os.path.realpath(path), stat.st_size, stat.st_mtime_ns)

    previous, gguf.GGUFReader = gguf.GGUFReader, shared
    try:
        yield
    finally:
        gguf.GGUFReader = previous  # an enclosing one_parse keeps its reader
