"""The paged KV cache's bookkeeping: which blocks of the pool each sequence's tokens live in, with
reference counts, and prefix caching.

The pool is `num_blocks` blocks of `block_size` tokens (the runner holds the memory: one key and one
value array per layer, `[num_blocks, block_size, kv_heads, head_dim]`). A sequence owns a list of
block ids, its block table; token i of the sequence lives in block `block_ids[i // block_size]`
at offset `i % block_size`.

Prefix caching: a full block is keyed by a sha256 of its tokens chained with the key of the block
before it (`block_hash`, prefix_keys.py), so a key names the whole prefix up to the block's end. A new sequence
reuses the cached blocks of its longest cached prefix, sharing them (reference counts), and computes
only the rest. A key is only where to look: a hit counts only when the block's own tokens and the
keyed block it was computed after are the sequence's (`_holds`), so two prefixes whose keys collide
never share KV (one request's prompt would otherwise reach another's output, vLLM's
GHSA-rm76-4mrf-v9r8); by induction from the first block, the hit blocks hold the sequence's prefix.
The last prompt token is always computed (its logits are the first sample), so a shared block is
never written. A LongRoPE model's KV depend on which side of its switch the sequence's length is
(runtime/engine/longrope.py): a sequence's blocks are keyed in a chain of their own for the long
factors (`long_rope`, set when it is given blocks), so short-factor blocks never serve a long prompt.
A sequence under a LoRA adapter keys its blocks in that adapter's chain (`adapter_key`: its name and content
digest, prefix_keys.py), so no hit crosses adapters, nor the base and an adapter.
A block no sequence holds keeps its key and stays reusable until the pool needs it: free blocks are
handed out first, then cached ones, least recently released first (LRU).

Beam search (runtime/engine/beam.py) shares blocks between beams: a beam forked from another holds its
parent's blocks (`fork`, reference counts up), and before a step writes a beam's next position the
block holding it is made the beam's own (`write_cost` / `make_writable`): a new block at a block
boundary, else a private copy of the partial last block while other beams still hold it
(copy-on-write; the caller copies the contents, PagedRunner.copy_blocks, before the step). Full
blocks are never written, so they stay shared however many beams descend from them.

nano-vllm's BlockManager has the same shape (can_allocate / allocate / can_append / append / free);
what is written here beyond it: the LRU order of released cached blocks, never sharing the block
that holds the last prompt token, and the beams' fork and copy-on-write.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterator, Protocol, Sequence

from llmc.runtime.engine import longrope
from llmc.runtime.engine.prefix_keys import ROOT, Keyed, block_hash, root, seed


class Blocked(Protocol):
    """What the block manager reads and writes on a sequence."""

    block_ids: list[int]
    num_cached: int  # tokens whose KV is in the sequence's blocks
    num_tokens: int  # prompt and output
    long_rope: bool  # its KV were computed with LongRoPE's long factors
    adapter_key: bytes | None  # its LoRA adapter's identity key (None: the base model)

    def all_token_ids(self) -> Sequence[int]: ...


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True,
                 longrope_switch: int | None = None):
        assert num_blocks >= 1 and block_size >= 1
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self.longrope_switch = longrope_switch  # kv_layout's: None for every model but LongRoPE ones
        self.ref_counts = [0] * num_blocks
        self.keys: list[bytes | None] = [None] * num_blocks  # a full block's prefix hash
        self._keyed: list[Keyed | None] = [None] * num_blocks  # set with its key
        self._serial = ROOT
        self._free = list(range(num_blocks - 1, -1, -1))  # never used, or released without a key; pop() = lowest
        self._cached: OrderedDict[int, None] = OrderedDict()  # released with a key, oldest first
        self._by_key: dict[bytes, int] = {}  # prefix hash -> block id
        self._memo: tuple[list[int], bytes | None, list[bytes]] = ([], None, [])  # _prefix_keys': the last lookup
        self.prefix_queries = self.prefix_hits = 0  # prompt tokens looked up / found, since start

    # the pool's state (metrics)
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free - self.num_cached

    @property
    def num_available(self) -> int:
        return len(self._free) + len(self._cached)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _block_tokens(self, tokens: Sequence[int], index: int) -> tuple[int, ...]:
        return tuple(tokens[index * self.block_size:(index + 1) * self.block_size])

    def _holds(self, block: int, parent: int, tokens: tuple[int, ...]) -> bool:
        """Whether keyed `block` was computed from `tokens` right after the keyed block `parent`."""
        keyed = self._keyed[block]
        return keyed is not None and keyed.parent == parent and keyed.tokens == tokens

    def _prefix_keys(self, tokens: Sequence[int], start: bytes | None) -> Iterator[bytes]:
        """The keys of the full blocks of `tokens` before the last token, in order, chained from `start`
        (prefix_keys.seed: the base's, LongRoPE's long factors', an adapter's), computed as they are asked for and
        remembered for the same tokens asked again (can_allocate, then allocate; the request at the head of the
        queue, every step it waits)."""
        memo_tokens, memo_start, keys = self._memo
        if memo_tokens != tokens or memo_start != start:
            keys = []
            self._memo = (list(tokens), start, keys)
        for index in range((len(tokens) - 1) // self.block_size):
            if index == len(keys):
                keys.append(block_hash(keys[-1] if keys else start, self._block_tokens(tokens, index)))
            yield keys[index]

    def is_long(self, seq: Blocked) -> bool:
        """Whether `seq`'s tokens, computed now, take LongRoPE's long factors (runtime/engine/longrope.py)."""
        return longrope.is_long(self.longrope_switch, seq.num_tokens)

    def _cached_prefix(self, tokens: Sequence[int], long: bool, adapter: bytes | None) -> list[int]:
        """The cached blocks of the longest cached prefix, never reaching the last token."""
        if not self.prefix_caching:
            return []
        found, parent = [], root(long, adapter)
        for index, key in enumerate(self._prefix_keys(tokens, seed(long, adapter))):
            block = self._by_key.get(key)
            if block is None or not self._holds(block, parent, self._block_tokens(tokens, index)):
                break  # not cached, or a collision: another prefix's block under this key
            found.append(block)
            parent = self._keyed[block].serial
        return found

    def can_allocate(self, seq: Blocked) -> bool:
        tokens = seq.all_token_ids()
        hits = self._cached_prefix(tokens, self.is_long(seq), seq.adapter_key)
        reusable = sum(1 for b in hits if self.ref_counts[b] == 0)  # hits now counted as available
        return self.blocks_for(len(tokens)) - len(hits) <= self.num_available - reusable

    def allocate(self, seq: Blocked) -> None:
        """Give `seq` blocks for all its tokens, sharing its cached prefix (its num_cached skips it);
        its KV will be computed with the RoPE factors its length picks now (`long_rope`)."""
        assert not seq.block_ids, "allocate() is for a sequence that holds no blocks"
        tokens = seq.all_token_ids()
        seq.long_rope = self.is_long(seq)
        hits = self._cached_prefix(tokens, seq.long_rope, seq.adapter_key)
        if self.prefix_caching:
            self.prefix_queries += len(tokens)
            self.prefix_hits += len(hits) * self.block_size
        for block in hits:
            self._hold(block)
        seq.block_ids = hits + [self._take() for _ in range(self.blocks_for(len(tokens)) - len(hits))]
        seq.num_cached = len(hits) * self.block_size

    def _missing(self, seq: Blocked, extra: int) -> int:
        return self.blocks_for(seq.num_tokens + extra) - len(seq.block_ids)

    def can_append(self, seq: Blocked, extra: int = 0) -> bool:
        """Whether the pool can cover every token `seq` has (a sampled token may need a new block), and
        `extra` positions beyond them (proposed tokens to verify)."""
        return self._missing(seq, extra) <= self.num_available

    def append(self, seq: Blocked, extra: int = 0) -> None:
        """Blocks for every token `seq` has and `extra` positions beyond: call after a token is
        appended, before the step that writes it."""
        seq.block_ids.extend(self._take() for _ in range(max(self._missing(seq, extra), 0)))

    def trim(self, seq: Blocked) -> None:
        """Give back the blocks past the ones `seq`'s tokens need: taken for proposals the target
        rejected. They hold no committed token (commit keys only blocks under num_cached, and a
        rejected position is past it), so they go back to the free list."""
        keep = self.blocks_for(seq.num_tokens)
        for block in reversed(seq.block_ids[keep:]):
            assert self.keys[block] is None and self.ref_counts[block] == 1
            self._release(block)
        del seq.block_ids[keep:]

    def commit(self, seq: Blocked) -> None:
        """Key the blocks `seq` has filled (its first num_cached tokens), so later prompts reuse them."""
        if not self.prefix_caching:
            return
        # a keyed block in a table holds that table's prefix (a hit, or keyed here): start after the last
        full = seq.num_cached // self.block_size
        if not full or self.keys[seq.block_ids[full - 1]] is not None:
            return  # no full block, or every one keyed already (a decode step that filled none)
        start = full
        while start > 0 and self.keys[seq.block_ids[start - 1]] is None:
            start -= 1
        key, parent = seed(seq.long_rope, seq.adapter_key), root(seq.long_rope, seq.adapter_key)
        if start:
            last = seq.block_ids[start - 1]
            key, parent = self.keys[last], self._keyed[last].serial
        tokens = seq.all_token_ids()
        for index in range(start, full):
            block, block_tokens = seq.block_ids[index], self._block_tokens(tokens, index)
            key = block_hash(key, block_tokens)
            holder = self._by_key.get(key)
            if holder is None:
                self._serial += 1
                self.keys[block], self._keyed[block] = key, Keyed(self._serial, parent, block_tokens)
                self._by_key[key] = block
                parent = self._serial
            elif self._holds(holder, parent, block_tokens):
                parent = self._keyed[holder].serial  # another row computed the same prefix: its block stands
            else:
                return  # a collision: the key is another prefix's, and the blocks from here stay unkeyed

    def fork(self, block_ids: Sequence[int]) -> list[int]:
        """`block_ids` held once more (a beam forked from their holder): a copy of the list."""
        for block in block_ids:
            self._hold(block)
        return list(block_ids)

    def _next_write(self, row: Blocked) -> int | None:
        """The index in `row.block_ids` of the block its next position (num_cached) falls in; None at a
        block boundary, where it needs a new block."""
        index = row.num_cached // self.block_size
        return index if index < len(row.block_ids) else None

    def write_cost(self, rows: Sequence[Blocked]) -> int:
        """The blocks `make_writable(rows)` takes: one per row at a block boundary, and one per
        row that finds its partial last block held by rows after it (the last holder keeps it)."""
        cost, seen = 0, {}
        for row in rows:
            index = self._next_write(row)
            if index is None:
                cost += 1
                continue
            block = row.block_ids[index]
            seen[block] = seen.get(block, 0) + 1
            cost += seen[block] < self.ref_counts[block]
        return cost

    def make_writable(self, rows: Sequence[Blocked]) -> list[tuple[int, int]]:
        """Give each row a block of its own for its next position (num_cached); returns the
        (shared source, private copy) pairs whose contents the caller copies before the step."""
        copies = []
        for row in rows:
            index = self._next_write(row)
            if index is None:
                row.block_ids.append(self._take())
                continue
            block = row.block_ids[index]
            if self.ref_counts[block] > 1:
                assert self.keys[block] is None, "a full (keyed) block is never written"
                row.block_ids[index] = self._take()
                self._release(block)
                copies.append((block, row.block_ids[index]))
        return copies

    def free(self, seq: Blocked) -> None:
        """Release `seq`'s blocks (newest first, so a prefix's tail is evicted before its head)."""
        for block in reversed(seq.block_ids):
            self._release(block)
        seq.block_ids = []
        seq.num_cached = 0

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        assert self.ref_counts[block] >= 0
        if self.ref_counts[block] == 0:
            if self.keys[block] is not None:
                self._cached[block] = None
            else:
                self._free.append(block)

    def _hold(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            self._cached.pop(block, None)
        self.ref_counts[block] += 1

    def _take(self) -> int:
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._cached.popitem(last=False)  # the least recently released cached block
            del self._by_key[self.keys[block]]
            self.keys[block], self._keyed[block] = None, None  # its serial dies: blocks keyed after it miss
        assert self.ref_counts[block] == 0
        self.ref_counts[block] = 1
        return block

