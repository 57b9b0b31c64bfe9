"""The KV-cache layout of an exported graph: described once, in the artifact; read from there.

Today's graphs take the past as inputs and return past + new as outputs (`update: concat`), one
key and one value tensor per layer, shape `[batch, num_kv_heads, seq, head_dim]`.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class KVLayout(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float32"
    dims: tuple[str, str, str, str] = ("batch", "num_kv_heads", "sequence", "head_dim")
    past_key: str = "past_key_values.{layer}.key"
    past_value: str = "past_key_values.{layer}.value"
    present_key: str = "present.{layer}.key"
    present_value: str = "present.{layer}.value"
    update: str = "concat"  # present = concat(past, new) along the sequence dim

    def past_names(self) -> list[str]:
        return [n.format(layer=i) for i in range(self.num_layers) for n in (self.past_key, self.past_value)]

    def present_names(self) -> list[str]:
        return [n.format(layer=i) for i in range(self.num_layers) for n in (self.present_key, self.present_value)]

    def shape(self, batch: int, seq: int) -> tuple[int, int, int, int]:
        return (batch, self.num_kv_heads, seq, self.head_dim)
