"""Where a LoRA branch sits in a served graph, and the names of the inputs it reads: the site table the build writes
into the manifest (compiler/lora/sites.py finds the sites, compiler/lora/graph.py adds the branches) and the runtime
binds a step's adapters through (stacks.py). Plain data: the runtime imports no compiler.

The flat-slot layout: a step's S adapters (slots), padded to one rank R, are concatenated along the rank axis, so a
site's stacks are plain matrices and its branch is four nodes (MatMul, Mul, MatMul, Add). K = M*R is one slot's
width at a site of M PEFT modules; slot s owns columns (of A; rows of B) s*K .. (s+1)*K, and within them module m
owns m*R .. m*R + its rank.

    lora.<site>.a   fp32 [in, S*K]          every slot's A side by side
    lora.<site>.b   fp32 [S*K, out]         every slot's B stacked, PEFT's scaling folded in, module m's rows written
                                            only into m's output columns (block-diagonal)
    lora_mask       fp32 [num_tokens, S*R]  1 in the columns of the token's own slot, 0 elsewhere (a token with no
    lora_mask_x<M>  fp32 [num_tokens, S*M*R] adapter: all 0); one per distinct M among the sites (Llama: 1 and 3)

An expert site (`experts` = E > 0) is one of a mixture layer's two expert weights, fc1 (gate and up, interleaved:
row 2j gate j, 2j + 1 up j) or fc2 (down), inside ONNX Runtime's MoE node: x is that node's input and y its output.
Its stacks hold every expert's pair, per slot side by side as above (one PEFT parameter: M = 1, the `lora_mask`):

    lora.<site>.a   fp32 [E, in, S*R]       expert e's A of slot s in [e, :, s*R ..]
    lora.<site>.b   fp32 [E, S*R, out]      its B, PEFT's scaling folded in, out in the op's row order

(compiler/lora/experts.py writes the branch that reads them: the MoE recomputed for a step's adapter tokens.)

Graphs built before the flat layout read `lora_slots` (int64 [num_tokens]) and [S, in, K] / [S, K, out] stacks:
the runtime refuses them, naming the rebuild (runtime/runners/paged_lora.py).
"""

from __future__ import annotations

from dataclasses import dataclass

OLD_SLOTS = "lora_slots"  # the stacked-slot layout's input: a graph that has it was built before the flat layout


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
    # the graph input picking the token rows the projection sees, when not every token's: the LM head's
    # `logits_indices` (its mask is the token mask gathered by it, in the graph: compiler/lora/graph.py)
    rows: str | None = None
    # an expert site (above): the mixture's expert count (0: a dense projection); `interleave`: PEFT's output rows
    # are [gate | up] and the op's are interleaved (fc1 of Mixtral and Qwen3-MoE, not gpt-oss's); `order`: the
    # parameter's place among its module's parameters, which fixes how PEFT nests two wrapped ones (adapter.py)
    experts: int = 0
    interleave: bool = False
    order: int = 0


def a_name(site: Site) -> str:
    return f"lora.{site.name}.a"


def b_name(site: Site) -> str:
    return f"lora.{site.name}.b"


def stack_shapes(site: Site, width: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of `site`'s stacks (or of one adapter's arrays) `width` columns wide: S*M*R, or M*r."""
    experts = (site.experts,) if site.experts else ()
    return (*experts, site.in_features, width), (*experts, width, site.out_features)


def mask_name(members: int) -> str:
    """The column mask of the sites with `members` PEFT modules."""
    return "lora_mask" if members == 1 else f"lora_mask_x{members}"


def mask_names(sites) -> list[str]:
    """The masks a graph with `sites` reads, one per distinct module count, in order of that count."""
    return [mask_name(m) for m in sorted({len(site.members) for site in sites})]
