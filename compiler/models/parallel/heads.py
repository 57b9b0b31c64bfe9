"""How N ranks share a model's attention heads (tensor parallelism, compiler/models/parallel/shard.py), decided
from the config alone (the plan reads it without loading weights).

KV heads: N divides them and each rank keeps KVH / N; or, with fewer KV heads than ranks, N is a multiple of
KVH and each KV head is replicated on N / KVH ranks (vLLM's rule), each rank keeping one. The query heads
always split evenly. `tensor_split(heads, kv_heads, n)` says which, or why not.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Split:
    """How N ranks share a model's attention heads."""

    ranks: int
    heads: int  # query heads per rank
    kv_heads: int  # KV heads per rank
    kv_replicas: int  # ranks holding each KV head (1: the KV heads split)

    def kv_range(self, rank: int) -> range:
        """The KV heads rank `rank` keeps."""
        first = rank * self.kv_heads if self.kv_replicas == 1 else rank // self.kv_replicas
        return range(first, first + self.kv_heads)


def tensor_split(heads: int, kv_heads: int, ranks: int) -> Split:
    """The split of `heads` query and `kv_heads` KV heads over `ranks`, or a ValueError saying what divides what."""
    if ranks < 1:
        raise ValueError(f"parallel.tensor must be at least 1 (got {ranks})")
    if heads % ranks:
        raise ValueError(f"parallel.tensor ({ranks}) must divide the model's {heads} attention heads")
    if kv_heads % ranks == 0:
        return Split(ranks, heads // ranks, kv_heads // ranks, 1)
    if ranks % kv_heads == 0:
        return Split(ranks, heads // ranks, 1, ranks // kv_heads)
    raise ValueError(f"parallel.tensor ({ranks}) must divide the model's {kv_heads} KV heads, or be a multiple of "
                     f"them (each KV head then kept by several ranks)")


UNSPLITTABLE = {"olmo2": "OLMo 2 normalizes the query and key projections over all heads together; a split would "
                         "need an all-reduce inside each norm"}


def check_split(config, ranks: int) -> None:
    """A ValueError naming `parallel.tensor` when a model of this (transformers) config cannot be split `ranks` ways."""
    from llmc.compiler.models.config import attention_shape

    if config.model_type in UNSPLITTABLE:
        raise ValueError(f"parallel.tensor: {ranks} cannot split {config.model_type}: {UNSPLITTABLE[config.model_type]}")
    heads, kv_heads, _ = attention_shape(config)
    tensor_split(heads, kv_heads, ranks)
