"""The KV-cache layout of an exported graph: described once, in the artifact; read from there.

One key and one value buffer per layer, shape `[batch, num_kv_heads, kv_capacity, head_dim]`,
preallocated at the serving capacity (`limits.max_seq_len`). A step feeds `input_ids [batch, S]`
and `cache_position` (int64 `[batch]`, how many tokens each row already has cached); the graph
writes row b's S new entries at `cache_position[b] ..` and returns the buffers as `present.*`,
same shape. Entries past a row's position are never read, so a slot needs no clearing and rows
may sit at different positions.

`in_place`: the graph updates the buffer it is given, so binding the same memory as `past_*` input
and `present.*` output (ONNX Runtime IO binding) makes a step copy nothing. Otherwise present is a
new tensor (the reference lowering copies the cache every step).
`max_prefill_rows`: a step with more than one token per row may hold at most this many rows
(GroupQueryAttention on CPU, a TensorRT engine's prefill profile); decode steps (one token per
row) take any batch. `dtype` is float32 on ONNX Runtime (the paged graph's pools: float32, float16 or
int8, `export.kv_cache_dtype`; int8 pools' scales are initializers of the graph), the engine's
precision on TensorRT.

`paged` (the paged lowering): the cache is a pool of blocks per layer, `[num_blocks, block_size,
num_kv_heads, head_dim]` (`dims`), and a step is packed tokens with no padding: `input_ids` and
`position_ids` `[num_tokens]`, the rows' `cumulative_sequence_length` int32 `[batch + 1]`,
`past_seqlens` int32 `[batch]` and `block_table` int32 `[batch, max_blocks]` (-1 where a row has no
block), and `logits_indices` int64 `[num_logits]` (the packed tokens that get logits) -> `logits
[num_logits, vocab]`; present aliases past (updated in place). `block_size` is the tokens per block
the runner allocates (the graph takes any). runtime/runners/paged.py drives it.

`longrope_switch` (LongRoPE models: Phi-3/3.5, Phi-4-mini; `original_max_position_embeddings`): the
graph takes one more input after the others, `sequence_lengths` int64 `[batch]`, each row's whole
sequence length (prompt and output so far, whatever part of it the step feeds), and rotates the
row's tokens with the long factors when it is above the switch (compiler/models/rope.py). A
sequence's KV therefore depend on which side of the switch its length is: runtime/engine/longrope.py.
Absent (None) for every other model, and then left out of the manifest.
"""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel, ConfigDict, model_serializer, model_validator


ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1}  # bytes per cache element, by `dtype`
SLOT_DIMS = ("batch", "num_kv_heads", "kv_capacity", "head_dim")
PAGED_DIMS = ("num_blocks", "block_size", "num_kv_heads", "head_dim")
# the paged graph's step inputs besides input_ids and position_ids, in graph order
PAGED_INPUTS = ("cumulative_sequence_length", "past_seqlens", "block_table", "logits_indices")
DEFAULT_BLOCK_SIZE = 16
SEQUENCE_LENGTHS = "sequence_lengths"  # LongRoPE graphs' last input (`longrope_switch`)


class KVLayout(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float32"
    dims: tuple[str, str, str, str] = SLOT_DIMS
    past_key: str = "past_key_values.{layer}.key"
    past_value: str = "past_key_values.{layer}.value"
    present_key: str = "present.{layer}.key"
    present_value: str = "present.{layer}.value"
    positions: str = "cache_position"
    in_place: bool = False
    max_prefill_rows: int | None = None
    paged: bool = False
    block_size: int | None = None  # tokens per block, paged layouts only
    longrope_switch: int | None = None  # LongRoPE: the graph takes `sequence_lengths` (see above)

    @model_validator(mode="after")
    def _block_size_iff_paged(self) -> "KVLayout":
        if self.paged != (self.block_size is not None):
            raise ValueError("kv_layout.block_size is set exactly when kv_layout.paged is true")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"kv_layout.block_size must be at least 1; got {self.block_size}")
        if self.longrope_switch is not None and self.longrope_switch < 1:
            raise ValueError(f"kv_layout.longrope_switch must be at least 1; got {self.longrope_switch}")
        return self

    @model_serializer(mode="wrap")
    def _without_unset_switch(self, handler):
        """No `longrope_switch` key unless set: the layouts of other models read as they always have."""
        data = handler(self)
        if self.longrope_switch is None:
            data.pop("longrope_switch", None)
        return data

    @property
    def step_inputs(self) -> tuple[str, ...]:
        """The graph's inputs after the KV pools or buffers: `sequence_lengths` for LongRoPE."""
        return (SEQUENCE_LENGTHS,) if self.longrope_switch is not None else ()

    @classmethod
    def paged_layout(cls, num_layers: int, num_kv_heads: int, head_dim: int,
                     block_size: int = DEFAULT_BLOCK_SIZE, dtype: str = "float32") -> "KVLayout":
        """The paged lowering's layout: block pools updated in place, positions from `position_ids`."""
        return cls(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, dims=PAGED_DIMS,
                   positions="position_ids", in_place=True, paged=True, block_size=block_size)

    def past_names(self) -> list[str]:
        return [n.format(layer=i) for i in range(self.num_layers) for n in (self.past_key, self.past_value)]

    def present_names(self) -> list[str]:
        return [n.format(layer=i) for i in range(self.num_layers) for n in (self.present_key, self.present_value)]

    def shape(self, batch: int, capacity: int) -> tuple[int, int, int, int]:
        return (batch, self.num_kv_heads, capacity, self.head_dim)

    def block_shape(self, num_blocks: int) -> tuple[int, int, int, int]:
        """One layer's key (or value) pool in a paged layout."""
        assert self.paged, "block_shape is for paged layouts"
        return (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * ITEMSIZE[self.dtype]


def check_step(layout: KVLayout, max_batch: int, capacity: int, shape: tuple[int, int], cache_position,
               first_row: int) -> None:
    """Refuse a step the cache or graph cannot take: rows outside the slots, positions past the
    capacity, more prefill rows than the graph runs at once."""
    n, s = shape
    if cache_position.shape != (n,):
        raise ValueError(f"cache_position has shape {cache_position.shape}; expected ({n},), one per row")
    if not 0 <= first_row <= first_row + n <= max_batch:
        raise ValueError(f"rows {first_row}..{first_row + n - 1} are outside the cache's {max_batch} slots")
    end = int(cache_position.max()) + s
    if int(cache_position.min()) < 0 or end > capacity:
        raise ValueError(f"KV cache overflow: a row would reach {end} tokens; capacity is {capacity}")
    limit = layout.max_prefill_rows
    if s > 1 and limit is not None and n > limit:
        raise ValueError(f"a step with {s} tokens per row may run at most {limit} row(s) on this graph; got {n}")


def step_lengths(layout: KVLayout, cache_position, num_new: int, sequence_lengths=None):
    """A slot step's `sequence_lengths` input (None for a graph without it): as given, else each row's
    last position this step + 1 (its tokens as if they were all of its sequence)."""
    if not layout.step_inputs:
        return None
    cache_position = np.asarray(cache_position)
    if sequence_lengths is None:
        return cache_position.astype(np.int64) + num_new
    lengths = np.ascontiguousarray(sequence_lengths, dtype=np.int64)
    if lengths.shape != cache_position.shape or bool((lengths <= cache_position).any()):
        raise ValueError(f"sequence_lengths {lengths.tolist()} must give each row ({cache_position.shape[0]}) a "
                         f"length beyond its cache_position {cache_position.tolist()}")
    return lengths
