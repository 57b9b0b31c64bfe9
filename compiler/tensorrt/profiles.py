"""The engine's two optimization profiles, from `limits`, over the same KV-cache inputs:

    prefill   one row, many tokens (the engine prefills one sequence per step)
    decode    one token per row, up to every KV slot

Profile keys may be patterns (`past_key_values.*`); `profile_shapes` expands them to the network's
inputs. The order is the runtime's profile index (runtime/runners/trt.py: PREFILL, DECODE).
Plain data: the dry run (plan.py) lists the same profiles the tensorrt stage builds.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Sequence

from llmc.compiler.spec import LimitsSpec
from llmc.errors import EngineError
from llmc.runtime.lora.sites import Site, a_name, b_name, mask_name, stack_shapes

PREFILL_OPT_TOKENS = 512  # the prefill profile's optimum: a typical prompt chunk

Shapes = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]  # (min, opt, max)


@dataclass(frozen=True)
class Profile:
    name: str
    shapes: dict[str, Shapes]  # input (or pattern) -> (min, opt, max)


def profiles(limits: LimitsSpec, num_kv_heads: int, head_dim: int, step_inputs: tuple[str, ...] = (),
             lora: tuple[Sequence[Site], int, int] | None = None,
             fixed: dict[str, tuple[int, ...]] | None = None) -> list[Profile]:
    """Prefill (one row, many tokens) and decode (one token per row, up to every slot) over one
    set of KV inputs `[batch, num_kv_heads, max_seq_len, head_dim]`; `step_inputs` (the layout's:
    LongRoPE's `sequence_lengths`) are shaped as cache_position. `lora`: (sites, lora.max_slots, lora.max_rank) of
    an engine with the LoRA branch: its stacks' width from 0 (a base-only step) to every slot at the highest rank,
    one adapter at it the optimum, and the masks [batch, seq, width] shaped as input_ids. TensorRT takes empty
    tensors (a dimension of 0) in a profile's minimum; never run here (docs/tensorrt.md). `fixed`: inputs of one
    shape in every profile (the attention plugins' key-split buffers, split_kv.py)."""
    kv = (num_kv_heads, limits.max_seq_len, head_dim)
    one_row = ((1, *kv),) * 3
    tokens, rows = limits.max_num_tokens, limits.max_batch_size
    prefill = {"input_ids": ((1, 2), (1, min(PREFILL_OPT_TOKENS, tokens)), (1, tokens)),
               "cache_position": ((1,), (1,), (1,)), "past_key_values.*": one_row}
    decode = {"input_ids": ((1, 1), (rows, 1), (rows, 1)),
              "cache_position": ((1,), (rows,), (rows,)),
              "past_key_values.*": ((1, *kv), (rows, *kv), (rows, *kv))}
    for name in step_inputs:
        prefill[name], decode[name] = prefill["cache_position"], decode["cache_position"]
    if lora is not None:
        sites, slots, rank = lora
        for site in sites:
            m = len(site.members)
            widths = (0, m * rank, slots * m * rank)  # min, opt, max
            a, b = zip(*(stack_shapes(site, w) for w in widths))
            prefill[a_name(site)] = decode[a_name(site)] = a
            prefill[b_name(site)] = decode[b_name(site)] = b
        for m in sorted({len(site.members) for site in sites}):
            lo, opt, hi = 0, m * rank, slots * m * rank
            prefill[mask_name(m)] = tuple((*ids, w) for ids, w in zip(prefill["input_ids"], (lo, opt, hi)))
            decode[mask_name(m)] = tuple((*ids, w) for ids, w in zip(decode["input_ids"], (lo, opt, hi)))
    for name, shape in (fixed or {}).items():
        prefill[name] = decode[name] = (shape,) * 3
    return [Profile("prefill", prefill), Profile("decode", decode)]


def profile_shapes(profile: Profile, inputs: list[str]) -> dict[str, Shapes]:
    """The (min, opt, max) shape of every network input under `profile`, whose keys may be
    patterns (`past_key_values.*`); an input no key matches is an error naming it."""
    shapes = {}
    for name in inputs:
        match = next((shape for key, shape in profile.shapes.items() if fnmatch.fnmatchcase(name, key)), None)
        if match is None:
            raise EngineError(f"profile {profile.name}: no shape for the network input {name!r} "
                              f"(the profile covers {sorted(profile.shapes)})")
        shapes[name] = match
    return shapes


def recorded_shapes(built: list[Profile], inputs: list[str]) -> dict[str, dict[str, list[list[int]]]]:
    """What the manifest records about the profiles an engine was built with: every network
    input's (min, opt, max) shapes, as lists."""
    return {p.name: {name: [list(s) for s in shape] for name, shape in profile_shapes(p, inputs).items()}
            for p in built}
