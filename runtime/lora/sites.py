"""Where a LoRA branch sits in a served graph, and the names of the inputs it reads: the site table the build writes
into the manifest (compiler/lora/sites.py finds the sites, compiler/lora/graph.py adds the branches) and the runtime
binds a step's adapters through (stacks.py). Plain data: the runtime imports no compiler.

    lora_slots      int64 [num_tokens]      each token's slot, -1 for none
    lora.<site>.a   fp32 [S, in, M*R]       slot s's A at the site; M = the site's PEFT modules, module m's
                                            columns m*R .. m*R + its rank
    lora.<site>.b   fp32 [S, M*R, out]      slot s's B, PEFT's scaling folded in, module m's rows written only into
                                            m's output columns (block-diagonal)
"""

from __future__ import annotations

from dataclasses import dataclass

SLOTS = "lora_slots"


@dataclass(frozen=True)
class Member:
    """One PEFT module's share of a site's output: columns offset .. offset + width."""

    module: str  # the checkpoint's module name, as PEFT keys it (model.layers.0.self_attn.q_proj)
    offset: int
    width: int


@dataclass(frozen=True)
class Site:
    name: str  # the decoder's module path without `decoder.`: `qkv.0`, `layers.0.mlp.down_proj`
    x: str  # the activation tensor the projection reads
    y: str  # the tensor holding its output (bias included)
    in_features: int
    out_features: int
    members: tuple[Member, ...]


def a_name(site: Site) -> str:
    return f"lora.{site.name}.a"


def b_name(site: Site) -> str:
    return f"lora.{site.name}.b"
