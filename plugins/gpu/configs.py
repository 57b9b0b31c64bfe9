"""Launch configurations of the attention kernels, as a function of head size and element size: the one
place both the PyTorch launches (kernels.py, paged_kernels.py) and the ahead-of-time compiles for the
TensorRT plugin (kernels_aot.py, paged_kernels_aot.py) take them from. Plain Python, no triton import: the
TensorRT preparation reads it (compiler/tensorrt/split_kv.py), and a process that imports triton before setting
TRITON_INTERPRET gets compiled kernels where the interpreter's are wanted (the CPU tests).

Why it is needed: Triton software-pipelines the loads of a loop, buffering `num_stages - 1` iterations of
every loaded tile in shared memory. A kernel launched from PyTorch is specialized on its 16-byte-aligned
pointers, which lets those loads become asynchronous copies and be buffered. When the one-launch kernels read
the step's new keys inside their key loop (7 tiles of BLOCK_N x BLOCK_D an iteration: cached keys and values,
new keys, their rotary partners, cos, sin, new values), 3 stages put them at 270,336 bytes for head_dim 256 in
fp16, over even an H100/H200's 232,448 ("out of resource: shared memory, Required: 270336"); that is where the
one stage past FRESH_ROW_BYTES comes from. Compiled without the alignment facts, as the plugins' ahead-of-time
compiles are, 16-bit loads are not buffered at all. Since the new keys moved to a one-stage loop of their own,
the key loops buffer keys and values only (fp16, aligned, 16 x 32 tiles, Triton 3.6 and 3.9, sm_80 = sm_90):

    kernel                          BLOCK_D 64     128       256   (bytes of shared memory)
    slot one-launch, 3 stages         19456      37888     74752
                     1 stage          10240      20480     40960   (head 256 fp16 keeps the stage it was measured at)
    paged, two launches or one, 5     19968      38400     75264   (TABLE_STAGES; fp32 at 256: 150080)
    (the split-KV forms, split_kv.py: the same figures, same configurations)

Every configuration a kernel may get stays within sm_80's 166912 bytes per block (the smaller of the two
generations; sm_90: 232448); tests/gpu/test_kernel_resources.py compiles each for both and checks the
figure the compiled kernel states. Head sizes 80 and 96 run in BLOCK_D 128 tiles (masked), so they share
128's configuration and its footprint.
"""

from __future__ import annotations

from dataclasses import dataclass

BLOCK_M, BLOCK_N = 16, 32  # queries (or (token, head) pairs) per program, keys per inner step
# The fewest keys a split of the one-launch and paged kernels gets: its fixed cost (the query tile, a partial of
# BLOCK_M x (D + 2) fp32 written and read back: 8 KiB at D 128) stays ~6% of the 128 KiB of fp16 keys and
# values it reads. A guess, not measured yet.
SPLIT_KEYS = 256
NUM_WARPS = 4
SHARED_LIMITS = {80: 166912, 90: 232448}  # bytes of shared memory one block may opt in to, by capability
# The widest tile row (bytes) the slot cache's one-launch kernel keeps 3 stages for (fp16 up to BLOCK_D 128); past
# it, the one stage it was measured at on the H200 (head 256: 0.96-1.03x SDPA) (attention_config)
FRESH_ROW_BYTES = 256
# The stages of the paged kernels' key loop (the two-launch form's attention, and the one-launch form's loop over
# cached blocks): 2 more than a direct load's 3, because Triton's pipeliner counts the block-table read before
# each key tile as a level of indirection and shares the stages among the levels: at 3 or 4 the key and value
# copies got one buffer and were waited for with nothing in flight, each tile loaded after the previous one's
# compute (plugins/gpu/pipelining.py reads it from the compiled IR; tests/gpu/test_kernel_resources.py checks
# every configuration). At 5, two buffers stay in flight, as the slot kernel's do at 3.
TABLE_STAGES = 5


@dataclass(frozen=True)
class KernelConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def launch(self) -> dict:
        """The launch options Triton takes, in a PyTorch launch (`kernel[grid](..., **launch())`) and in
        `triton.compile(..., options=...)` alike."""
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}


def block_d(head_dim: int) -> int:
    """The channel tile of a head: the next power of two (a dot needs at least 16)."""
    return max(16, 1 << (head_dim - 1).bit_length())  # triton.next_power_of_2, without importing triton here


# Hopper's decode configurations, keyed by `paged`, from an H200 (`python -m llmc.bench gpu-kernels --kind tune`,
# 2026-11-30, fp16, 32 query heads over 8 KV heads, head 128, at batch x context 32 x 4k, 8 x 32k, 64 x 8k and 1 x
# 128k; 9 configurations x 2 split counts a kernel, all at 3 or 4 stages). Fastest at all four shapes, against 32
# keys, 4 warps, 3 stages:
#   the slot cache's one-launch kernel:            64 keys, 4 warps: 0.60-0.61x SDPA (was 0.51-0.55x);
#   the paged kernel after its write launch:      128 keys, 8 warps: 0.69-0.80x SDPA (was 0.24-0.74x);
#   the paged one-launch kernel, at 64 x 4 x 3:    0.40-0.44x (was 0.20-0.42x).
# The paged kernels were timed only at stage counts that overlap none of their loads (TABLE_STAGES), and the
# one-launch forms with the new keys' branch in their key loop (now in a loop of its own); both paged kernels
# now take 64 keys, 4 warps and TABLE_STAGES (72,704 bytes at head 128, two tiles in flight), chosen from the
# compiled IR and not yet timed on a GPU. Used by PyTorch launches on a GPU of capability 9.0 or later, for 16-bit
# heads up to 128 (what was measured); the TensorRT plugins' ahead-of-time kernels keep the configurations below,
# as do other GPUs and head sizes.
HOPPER_DECODE = {False: KernelConfig(BLOCK_M, 64, 4, 3), True: KernelConfig(BLOCK_M, 64, 4, TABLE_STAGES)}


def attention_config(head_dim: int, itemsize: int, *, paged: bool, capability: int | None = None) -> KernelConfig:
    """The configuration of a decode attention kernel over heads of `head_dim` channels of `itemsize` bytes.
    `paged`: a paged kernel (two launches or one), whose key loop reads the cache through the block table
    (TABLE_STAGES); else the slot cache's one-launch kernel (3 stages up to FRESH_ROW_BYTES rows, then 1). The
    one-launch forms read the step's new keys in a one-stage loop of their own, after the key loop. Stages never
    increase with the row width, so the widest row that gets a stage count is its largest footprint (what the
    resource test uses). `capability` (as 90): a PyTorch launch's GPU, which on Hopper and later takes
    HOPPER_DECODE where it was measured; None (the plugins' compiles, the interpreter) the portable rule."""
    if capability is not None and capability >= 90 and itemsize == 2 and block_d(head_dim) <= 128:
        return HOPPER_DECODE[paged]
    if paged:  # every head size and type fits (fp32 at head 256: 150,080 bytes)
        stages = TABLE_STAGES
    else:
        stages = 3 if block_d(head_dim) * itemsize <= FRESH_ROW_BYTES else 1
    return KernelConfig(BLOCK_M, BLOCK_N, NUM_WARPS, stages)


def decode_splits(batch: int, kv_heads: int, context: int, num_sms: int = 132, min_keys: int = SPLIT_KEYS) -> int:
    """How many ways to split the keys of each of `batch` x `kv_heads` programs (for the one-launch and paged
    kernels, `batch` counts row tiles): about 2 programs per SM (`num_sms`: an H100/H200 has 132), never slices
    shorter than `min_keys` of `context` keys; a power of two. `context` is a bound from shapes (the cache's
    capacity, the block table's reach), so a plugin's count, fixed at build, follows the same rule."""
    want = max(1, min(2 * num_sms // max(batch * kv_heads, 1), context // min_keys))
    return 1 << (want.bit_length() - 1)


# The prefill kernel's tiles (plugins/gpu/prefill.py: FlashAttention-2's loop, one query head a program), per GPU
# generation, in order of preference: FlashAttention-2's and Triton's fused-attention tutorial's choices for A100
# (sm_80: 128 x 64, 4 warps) and H100 (sm_90: 128 x 128 or 128 x 64, 8 warps), then smaller ones. They read the
# paged cache through the block table, so they take TABLE_STAGES: at 3 stages (the tutorial's) every one of them
# compiled to a loop that waits for all its copies at each step; 128 x 32 with 4 warps, 3 stages, was the fastest
# of them on an H200 (153 TFLOP/s at 8k tokens, head 128, against 138 for the best of the others, and 290-302 for
# the slot cache's kernel, which has no table: gpu-kernels --kind tune, 2026-11-30); the 5-stage tiles are not yet
# timed. Not every one fits every head size and type: prefill.fitting_configs drops those whose compiled shared
# memory passes the generation's limit (compiling for the target, as the resource test does), and on a GPU
# triton.autotune picks among the rest. The last of each list (one stage) fits every head size up to 256 in fp32.
PREFILL_CONFIGS = {
    80: (KernelConfig(128, 64, 4, TABLE_STAGES), KernelConfig(64, 64, 4, TABLE_STAGES),
         KernelConfig(64, 32, 4, TABLE_STAGES), KernelConfig(32, 32, 4, 1)),
    90: (KernelConfig(128, 128, 8, TABLE_STAGES), KernelConfig(128, 64, 8, TABLE_STAGES),
         KernelConfig(128, 32, 4, TABLE_STAGES), KernelConfig(64, 64, 4, TABLE_STAGES), KernelConfig(32, 32, 4, 1)),
}


def generation(capability: int) -> int:
    """The configuration list a GPU of compute capability `capability` (as 80, 86, 90, 100) takes: Hopper's from
    90 on, Ampere's below (Ada, 89, has Ampere's shared memory per block: 99 KiB, under sm_80's 163 KiB; the
    compiled figure decides there too)."""
    return 90 if capability >= 90 else 80


def default_config() -> KernelConfig:
    """The kernels that buffer nothing of size, with Triton's defaults: the paged cache write (no loop over keys;
    block sizes unused)."""
    return KernelConfig(1, BLOCK_N, NUM_WARPS, 3)
