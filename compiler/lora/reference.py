"""The LoRA branch's reference in PyTorch: what graph.py's branch must compute, written the way an op of llmc's
own would run it (shrink, then expand, over the active slots only: the tokens of each slot gathered, multiplied
by that slot's A then B, scattered back), so it is also the oracle llmc's fused op (llmc.LoraDelta, runtime/kernels/lora_delta/) is tested against. It reads
the flat stacks the runtime binds (runtime/lora/sites.py): slot s's A in columns s*K .. (s+1)*K, its B in those rows.

    lora_delta(x [N, in], slots int64 [N], a [in, S*K], b [S*K, out], num_slots S) -> [N, out]
        row n: x[n] @ A_s @ B_s for s = slots[n], or 0 where slots[n] is -1 (or names no slot)
"""

from __future__ import annotations

import torch
from torch import Tensor


def lora_delta(x: Tensor, slots: Tensor, a: Tensor, b: Tensor, num_slots: int) -> Tensor:
    if a.shape[1] != b.shape[0] or a.shape[1] % num_slots:
        raise ValueError(f"stacks a {list(a.shape)}, b {list(b.shape)} are not {num_slots} slots side by side")
    k = a.shape[1] // num_slots  # one slot's width
    out = x.new_zeros(x.shape[0], b.shape[-1])
    for s in torch.unique(slots).tolist():  # the active slots only: a step reads no other adapter's weights
        if not 0 <= s < num_slots:
            continue
        rows = (slots == s).nonzero(as_tuple=True)[0]
        out[rows] = (x[rows] @ a[:, s * k:(s + 1) * k]) @ b[s * k:(s + 1) * k]  # shrink to the rank, then expand
    return out
