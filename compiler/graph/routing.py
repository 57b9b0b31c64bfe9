"""Routing near-ties in the reference: where a mixture's router could pick either of two experts.

A router picks a token's top k experts by their logits (softmax is monotone, so the order is the logits' for
every family: Mixtral, Qwen3-MoE and gpt-oss alike). Where the k-th and the (k+1)-th logits lie closer than the
two implementations' float32 noise, PyTorch and ONNX Runtime may legitimately pick different experts: a tiny
Mixtral with a planted gap of 4.8e-7 in one token's router verified with |Δlogit| 4.5 at that token and after,
though both graphs compute the same function and the greedy tokens stayed equal (issue 51; a gap of 3.8e-5
verified at 2e-4). Exact ties are broken apart too: torch.topk keeps the lower expert, ONNX Runtime's MoE the
higher. So verify records, per sequence position, the smallest such margin over the layers, and compares logits
only before the first position whose margin is a near tie (graph/verify.py). Greedy tokens are still compared
over every step.

Written here because the HF routers expose no margins: each router module's input is caught with a forward
pre-hook and its logits recomputed (F.linear with its own weight and bias).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import numpy as np


def routers(model) -> list:
    """The model's router modules: a `top_k` and a [experts, hidden] weight (transformers' TopKRouter classes)."""
    return [m for m in model.modules()
            if isinstance(getattr(m, "top_k", None), int) and getattr(m, "weight", None) is not None
            and m.weight.ndim == 2 and m.weight.shape[0] > m.top_k]


class RoutingMargins:
    """The smallest top-k margin (k-th minus (k+1)-th router logit) over the layers, per sequence position."""

    def __init__(self) -> None:
        self.margins = np.full(0, np.inf)
        self._start = 0

    def at(self, start: int) -> None:
        """The next forward call's tokens sit at positions start, start + 1, ..."""
        self._start = start

    def record(self, logits: np.ndarray, k: int) -> None:
        ordered = -np.sort(-logits.reshape(-1, logits.shape[-1]), axis=-1)
        margin = ordered[:, k - 1] - ordered[:, k]
        end = self._start + len(margin)
        if end > len(self.margins):
            self.margins = np.concatenate([self.margins, np.full(end - len(self.margins), np.inf)])
        self.margins[self._start:end] = np.minimum(self.margins[self._start:end], margin)

    def first_tie(self, bound: float) -> int | None:
        """The first position whose routing margin is at most `bound`, None if there is none."""
        return first_tie(self.margins, bound)


def first_tie(margins: np.ndarray, bound: float) -> int | None:
    """The first position of `margins` (per position) at most `bound`, None if there is none."""
    ties = np.nonzero(margins <= bound)[0]
    return int(ties[0]) if ties.size else None


@contextlib.contextmanager
def recording(model) -> Iterator[RoutingMargins | None]:
    """Record `model`'s routing margins while the block runs; None for a model without routers (dense)."""
    import torch.nn.functional as F

    found = routers(model)
    if not found:
        yield None
        return
    margins = RoutingMargins()

    def hook(module, args):
        logits = F.linear(args[0], module.weight, getattr(module, "bias", None))
        margins.record(logits.detach().float().numpy(), module.top_k)

    handles = [m.register_forward_pre_hook(hook) for m in found]
    try:
        yield margins
    finally:
        for h in handles:
            h.remove()
