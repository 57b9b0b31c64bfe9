"""The LoRA branch's reference in PyTorch: what graph.py's branch must compute, written the way an op of llmc's
own would run it (shrink, then expand, over the active slots only: the tokens of each slot gathered, multiplied
by that slot's A then B, scattered back), so it is also the oracle a future fused kernel is tested against.

    lora_delta(x [N, in], slots int64 [N], a [S, in, R], b [S, R, out]) -> [N, out]
        row n: x[n] @ a[slots[n]] @ b[slots[n]], or 0 where slots[n] is -1 (or names no slot)
"""

from __future__ import annotations

import torch
from torch import Tensor


def lora_delta(x: Tensor, slots: Tensor, a: Tensor, b: Tensor) -> Tensor:
    out = x.new_zeros(x.shape[0], b.shape[-1])
    for s in torch.unique(slots).tolist():  # the active slots only: a step reads no other adapter's weights
        if not 0 <= s < a.shape[0]:
            continue
        rows = (slots == s).nonzero(as_tuple=True)[0]
        out[rows] = (x[rows] @ a[s]) @ b[s]  # shrink to the rank, then expand to the outputs
    return out
