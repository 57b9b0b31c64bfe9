"""Split-KV (flash-decoding) inside one launch, for the one-launch kernels (one_launch.py) and the paged kernel
(paged_kernels.py).

Why: a decode step has one query per row, so a kernel with one program per (row tile, KV head) runs batch x KV
heads programs; at a small batch and a long context that leaves most of a GPU's SMs idle (the H100/H200 runs of
issue 55: 0.15x SDPA at batch 8, context 32k). A third grid axis of programs divides each tile's keys among them,
each computing a partial softmax over its slice (compiled in with SPLITS > 1; the axis's size is the count).

Why merged in the same launch: the TensorRT plugin gets one kernel per node (an ahead-of-time plugin returns
one PTX entry and one grid), and its grid must be a function of tensor shapes only. So every program stores its
partial (running max, sum, fp32 accumulator) in a workspace, and counts itself in with an atomic on its tile's
counter; the program that finds the count at the axis's size - 1 is the tile's last, reads every partial back,
merges them and writes the output, then sets the counter back to 0 for the next launch. No program waits for another, so it runs under the interpreter too (programs there run one
after another; the last one merges).

Workspace, per tile (grid x, grid y) and split: BLOCK_M x (D + 2) fp32 (the accumulator rows, then the max and
the sum of each row); `workspace_floats` gives the size from shapes. Counters: one int32 per tile, zero before
the first launch; the kernel leaves them at zero. Two launches that share counters must not run at the same
time (one stream).

Two ways to size them. A PyTorch launch picks its split count from the shapes (configs.decode_splits) and gets
a workspace for exactly that (`split_workspace`). A TensorRT plugin's launch cannot: its buffers are engine inputs
of a fixed size, bound once (compiler/tensorrt/split_kv.py), SLOTS partials. So its grid's third axis is a shape
expression (`plugin_splits`): decode_splits' rule on the launch's own tiles, capped at the node's key_splits and at
SLOTS // tiles, so the partials always fit; at one split nothing touches the workspace (a prefill, or a batch whose
tiles fill the GPU). SLOTS = 2 x the SMs is enough: the rule stops at about 2 programs per SM. The kernels take
their split count from the grid (`tl.num_programs(2)`), whichever way it was sized.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmc.plugins.gpu.configs import BLOCK_M, SPLIT_KEYS, decode_splits
from llmc.plugins.gpu.kernels import INTERPRETED

_counters: dict[torch.device, torch.Tensor] = {}


def plugin_splits(tiles, keys, splits: int, slots: int, *, minimum=min, maximum=max, constant=int):
    """A plugin launch's key splits, its grid's third axis: of the node's `splits`, no more than the workspace's
    `slots` partials hold for `tiles` (grid x times grid y) nor than slices of SPLIT_KEYS of `keys` (a bound from
    shapes: the cache's capacity, the block table's reach), at least 1: decode_splits' rule, not rounded to a power
    of two (the merge takes any count). On ints, or on TensorRT's shape expressions (`minimum=trtp.min`,
    `maximum=trtp.max`, `constant=trtp.ShapeExpr`: an expression's // takes an int on its right only)."""
    if splits <= 1:
        return 1
    return maximum(minimum(minimum(constant(slots) // tiles, keys // SPLIT_KEYS), splits), 1)


@triton.jit
def split_keys(lo, hi, splits, BLOCK_N: tl.constexpr):
    """This program's slice [start, stop) of a tile's keys [lo, hi) among `splits`, in whole key blocks of BLOCK_N,
    and how many splits hold any key (the rest, past the tile's keys, hold none: a short row leaves most splits
    empty). `splits`: the grid's third axis."""
    keys = tl.maximum(hi - lo, 0)
    per = tl.maximum(tl.cdiv(tl.cdiv(keys, splits), BLOCK_N), 1) * BLOCK_N
    start = lo + tl.program_id(2) * per
    return start, tl.minimum(start + per, hi), tl.cdiv(keys, per)


@triton.jit
def tile_and_split():
    """This program's tile (its place in grid x and y, which index the workspace and counters) and split."""
    return tl.program_id(0) + tl.program_id(1) * tl.num_programs(0), tl.program_id(2)


@triton.jit
def merge_splits(acc, m_i, l_i, part_ptr, lock_ptr, tile, split, active, d, D: tl.constexpr, splits,
                 BLOCK_M: tl.constexpr):
    """Store this program's partial softmax of its tile (acc [BLOCK_M, BLOCK_D], running max and sum [BLOCK_M])
    and count it in; returns the tile's merged (acc, max, sum) and, as a [BLOCK_M, 1] mask, whether this program
    is the tile's last, the one to write the output (for the others the merged values are meaningless).
    `active`: the splits that hold keys (split_keys); empty ones store nothing and are not read. `splits`: the
    tile's programs (the grid's third axis)."""
    rows = tl.arange(0, BLOCK_M)
    d_ok = (d < D)[None, :]
    SIZE: tl.constexpr = BLOCK_M * (D + 2)
    at = (tile.to(tl.int64) * splits + split) * SIZE
    holds = (split + 0 * rows) < active  # as a row tensor: the interpreter takes no scalar masks on tiles
    tl.store(part_ptr + at + rows[:, None] * D + d[None, :], acc, mask=d_ok & holds[:, None])
    tl.store(part_ptr + at + BLOCK_M * D + rows, m_i, mask=holds)
    tl.store(part_ptr + at + BLOCK_M * (D + 1) + rows, l_i, mask=holds)
    tl.debug_barrier()  # every thread's stores before the count, which one thread makes
    last = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel", scope="gpu") == splits - 1
    reads = (last + 0 * rows) != 0
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_M], tl.float32)
    merged = tl.zeros_like(acc)
    for other in range(0, active):  # the online softmax's rescaling, one partial at a time
        at = (tile.to(tl.int64) * splits + other) * SIZE
        m_o = tl.load(part_ptr + at + BLOCK_M * D + rows, mask=reads, other=float("-inf"), cache_modifier=".cg")
        l_o = tl.load(part_ptr + at + BLOCK_M * (D + 1) + rows, mask=reads, other=0.0, cache_modifier=".cg")
        a_o = tl.load(part_ptr + at + rows[:, None] * D + d[None, :], mask=d_ok & reads[:, None], other=0.0,
                      cache_modifier=".cg")
        top = tl.maximum(m, m_o)
        safe = tl.where(top == float("-inf"), 0.0, top)  # rows no split saw stay 0, not NaN
        mine, theirs = tl.exp2(m - safe), tl.exp2(m_o - safe)  # the maxima are in base 2 (kernels.logits)
        merged = merged * mine[:, None] + a_o * theirs[:, None]
        s = s * mine + l_o * theirs
        m = top
    tl.atomic_xchg(lock_ptr + tile, 0, mask=last)  # ready for the next launch
    return merged, m, s, reads[:, None]


def num_sms(device: torch.device) -> int:
    """The SMs the split count fills: the GPU's, or an H100's 132 where there is none (the interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132


def launch_capability(tensor: torch.Tensor) -> int | None:
    """The compute capability (as 90) of the GPU a PyTorch launch over `tensor` runs on, for configs'
    per-generation choices; None off the GPU or under the interpreter."""
    if tensor.device.type != "cuda" or INTERPRETED:
        return None
    major, minor = torch.cuda.get_device_capability(tensor.device)
    return 10 * major + minor


def workspace_floats(tiles: int, splits: int, block_m: int, head_dim: int) -> int:
    """fp32 elements of the partials' workspace for `tiles` (grid x times grid y) programs split `splits` ways."""
    return tiles * splits * block_m * (head_dim + 2)


def split_workspace(device: torch.device, tiles: int, splits: int, block_m: int, head_dim: int):
    """(partials, counters) for a PyTorch launch. The counters persist per device, zero between launches (each
    launch sets back what it counted), so a launch costs no memset: as a plugin's would."""
    part = torch.empty(workspace_floats(tiles, splits, block_m, head_dim), dtype=torch.float32, device=device)
    counters = _counters.get(device)
    if counters is None or counters.numel() < tiles:
        counters = _counters[device] = torch.zeros(max(tiles, 1024), dtype=torch.int32, device=device)
    return part, counters


def split_buffers(query, grid_x: int, kv_num_heads: int, context: int, head_size: int, splits: int | None,
                  busy: int | None = None):
    """(key splits, workspace, counters) of a paged launch of `grid_x` x `kv_num_heads` tiles: `splits`, or
    decode_splits from the shapes (`context`: what the block table reaches), the GPU's SMs and the `busy` tiles of
    the grid's x (paged_kernels.busy_tiles; default all); without splits, placeholders the kernel never reads."""
    splits = splits or decode_splits(busy or grid_x, kv_num_heads, context, num_sms(query.device))
    if splits == 1:
        return 1, query, query
    return splits, *split_workspace(query.device, grid_x * kv_num_heads, splits, BLOCK_M, head_size)
