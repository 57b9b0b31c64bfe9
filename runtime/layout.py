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
(GroupQueryAttention on CPU); decode steps (one token per row) take any batch.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class KVLayout(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float32"
    dims: tuple[str, str, str, str] = ("batch", "num_kv_heads", "kv_capacity", "head_dim")
    past_key: str = "past_key_values.{layer}.key"
    past_value: str = "past_key_values.{layer}.value"
    present_key: str = "present.{layer}.key"
    present_value: str = "present.{layer}.value"
    positions: str = "cache_position"
    in_place: bool = False
    max_prefill_rows: int | None = None

    def past_names(self) -> list[str]:
        return [n.format(layer=i) for i in range(self.num_layers) for n in (self.past_key, self.past_value)]

    def present_names(self) -> list[str]:
        return [n.format(layer=i) for i in range(self.num_layers) for n in (self.present_key, self.present_value)]

    def shape(self, batch: int, capacity: int) -> tuple[int, int, int, int]:
        return (batch, self.num_kv_heads, capacity, self.head_dim)

    def bytes_per_token(self) -> int:
        import numpy as np

        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * np.dtype(self.dtype).itemsize
