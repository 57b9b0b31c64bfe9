"""The prefix cache's keys (block_manager.py): a full block's key chains a sha256 of its tokens to the key of the
block before it, so a key names the whole prefix up to the block's end; what a keyed block held, checked on a
hit; and where the chain starts, apart for LongRoPE's long factors (runtime/engine/longrope.py) and for each LoRA
adapter (its identity's key, runtime/lora/stacks.py's AdapterRef.key: name and content digest), whose KV differ.

An adapter's chain starts from a seed of its own, and its first block's parent is that seed (bytes, which no
block's serial equals), so neither a key nor the check on a hit ever matches a block computed under the base, under
another adapter, or under an adapter of the same name with other weights (reloaded: another digest, another key).
"""

from __future__ import annotations

import hashlib
from array import array
from typing import NamedTuple, Sequence


def block_hash(previous: bytes | None, tokens: Sequence[int]) -> bytes:
    """The key of a full block: sha256 over the previous block's key (32 bytes; none for the first
    block) and this block's token ids (8 bytes each). Python's hash() of a tuple was here: unkeyed
    and cheap to collide on purpose. sha256 because it is the fastest strong hash hashlib has for
    inputs this short (~3 us a 16-token block on one core, blake2b the same, hash() ~0.4 us): it runs
    once per full block a prompt is looked up with (BlockManager._prefix_keys remembers them) and once
    per block computed (its `commit` hashes only the blocks it has not keyed yet)."""
    return hashlib.sha256((previous or b"") + array("q", tokens).tobytes()).digest()


class Keyed(NamedTuple):
    """What a keyed block holds, checked on a hit."""

    serial: int  # names this keying of the block: a block keyed again (after eviction) gets a new one
    parent: int | bytes  # the serial of the keyed block before it (a first block: root(), bytes under an adapter)
    tokens: tuple[int, ...]


ROOT = 0  # the serial of the empty prefix
LONG_ROOT = -1  # ... of the empty prefix under LongRoPE's long factors
LONG_SEED = hashlib.sha256(b"llmc: LongRoPE long factors").digest()  # the key chain's start under them


def seed(long: bool, adapter: bytes | None = None) -> bytes | None:
    """What the first block's key is chained to: nothing, or the long factors' seed; under a LoRA adapter (its key),
    a seed of the adapter's own."""
    if adapter is None:
        return LONG_SEED if long else None
    return hashlib.sha256(b"llmc: lora chain\0" + adapter + (b"\0long" if long else b"")).digest()


def root(long: bool, adapter: bytes | None = None) -> int | bytes:
    """The serial a first block's parent has: the empty prefix's, or its own under the long factors; under a LoRA
    adapter, the adapter's seed itself (no serial equals it)."""
    if adapter is None:
        return LONG_ROOT if long else ROOT
    return seed(long, adapter)
