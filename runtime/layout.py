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
row) take any batch. `dtype` is float32 on ONNX Runtime, the engine's precision on TensorRT.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}  # bytes per cache element, by `dtype`


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
