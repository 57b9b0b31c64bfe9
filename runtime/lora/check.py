"""An adapter file checked against the served base before it is served (an adapter loaded at run time,
runtime/serving/lora_admin.py, and the adapters of the repository's store at load, runtime/serving/loader.py):
every site it names is one of the manifest's, its stacks have that site's shapes at the adapter's rank, and the rank
is within lora.max_rank. The message names the adapter and what is wrong, so the operator can act on it.

The compiler's side checks a PEFT adapter against the base model's modules (compiler/lora/adapter.py); this is the
same check on the site layout the build (or `llmc adapters load`) wrote, which is all a running model has.
"""

from __future__ import annotations

import re
from typing import Mapping, Sequence

import numpy as np

from llmc.runtime.lora.sites import Site, stack_shapes
from llmc.runtime.lora.stacks import AdapterWeights

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # a model name's alphabet (compiler/spec/adapters.py)


class AdapterRefused(ValueError):
    """An adapter that does not fit the served base; the message names the adapter and the field at fault."""


def check_name(name: str) -> None:
    if not NAME.fullmatch(name):
        raise AdapterRefused(f"lora_name: {name!r} is not an adapter name (letters, digits, _ . -, at most 64, "
                             f"starting with a letter or digit)")


def check_shapes(name: str, rank: int, shapes: Mapping[str, tuple[tuple, tuple]], sites: Sequence[Site],
                 max_rank: int) -> None:
    """`shapes`: site -> (a's shape, b's shape) of adapter `name` whose highest rank is `rank`."""
    if not 1 <= rank <= max_rank:
        raise AdapterRefused(f"adapter {name!r}: rank {rank} is {'above' if rank > max_rank else 'below'} what this "
                             f"model serves (lora.max_rank {max_rank}; rebuild with a higher lora.max_rank to serve it)")
    if not shapes:
        raise AdapterRefused(f"adapter {name!r}: it targets no site of this model")
    by_name = {site.name: site for site in sites}
    stray = sorted(set(shapes) - set(by_name))
    if stray:
        raise AdapterRefused(f"adapter {name!r}: this model has no site {', '.join(stray[:3])} (the adapter was made "
                             f"for another base, or for modules this model serves no adapter on)")
    for site_name, (a, b) in sorted(shapes.items()):
        site = by_name[site_name]
        want_a, want_b = stack_shapes(site, len(site.members) * rank)
        if tuple(a) != want_a or tuple(b) != want_b:
            raise AdapterRefused(f"adapter {name!r}: site {site_name}'s stacks are a {list(a)}, b {list(b)}; this "
                                 f"model's are a {list(want_a)}, b {list(want_b)} at rank {rank} (the adapter was "
                                 f"made for another base)")


def check_weights(weights: AdapterWeights, sites: Sequence[Site], max_rank: int) -> None:
    """`weights` fit the served base (shapes, sites, rank) and hold finite numbers; AdapterRefused otherwise."""
    check_name(weights.ref.name)
    check_shapes(weights.ref.name, weights.rank, {s: (a.shape, b.shape) for s, (a, b) in weights.sites.items()},
                 sites, max_rank)
    for site_name, (a, b) in sorted(weights.sites.items()):
        if not (np.isfinite(a).all() and np.isfinite(b).all()):
            raise AdapterRefused(f"adapter {weights.ref.name!r}: site {site_name} holds NaN or infinite values")
