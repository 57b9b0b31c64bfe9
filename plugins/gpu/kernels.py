"""The Triton building blocks every attention kernel shares: rotary embedding on the fly (`rows`: a tile of the
inputs, rotated or not), one block of an online softmax (`softmax_block`), a block of keys and values folded into
it with the masks (`fold_keys`), base-2 logits with the softcap (`logits`, `capped`) and attention sinks joining a
finished softmax (`with_sink`). The kernels built from them:

- one_launch.py: `llmc::attention` (plugins/op/attention.py) over the slot cache in one launch, prefill and
  decode, split-KV merged in the launch (split_kv.py); the TensorRT plugin's kernel (kernels_aot.py);
- paged_kernels.py / paged_kernels_aot.py: the paged op (decode and mixed steps), two launches or one;
- prefill.py: prompt chunks over the paged cache in FlashAttention-2's tiles;
- fp8.py: the fp8 (e4m3) KV cache's conversions.

The three-launch slot kernel that lived here (rotary + cache write, a per-query-head prefill and a split decode
with a separate merge launch) was removed for issue 55: the one-launch kernel does all it did in one launch,
reads each KV byte once per group instead of once per query head, and was faster on the H200 at every measured
decode shape (0.13x and 0.08x of SDPA for the three launches against 0.63x and 0.21x); its prefill, 16-query
tiles like the one-launch kernel's, is what prefill.py replaces for the paged cache.

The attention features (plugins/op/attention.py) are compile-time constants in every kernel: SOFTCAP > 0 caps the
scaled logits, WINDOW > 0 starts each query's keys at position - WINDOW + 1, and SINKS reads one sink logit per
head into the denominator when a softmax is finished (`with_sink`). GQA: query head h reads KV head h // (H / KVH).
fp16, bf16 and fp32 inputs; accumulation in fp32. Everything runs on CPU under `TRITON_INTERPRET=1` (how the tests
check it against the reference) and compiles for sm_80 / sm_90 without a GPU (kernels_aot._compile).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rows(x_ptr, offsets, d, mask, positions, cos_ptr, sin_ptr, HALF: tl.constexpr, ROTARY: tl.constexpr,
         INTERLEAVED: tl.constexpr):
    """x[offsets + d] in fp32 (every kernel's queries and new keys, read from the inputs); with ROTARY rotated at
    `positions` ([rows]) over its first 2 * HALF channels: pairs (i, i + HALF) (rotate-half) or (2i, 2i + 1)
    (interleaved); the channels after pass through. One function, not a wrapper around a rotating one: the
    interpreter, which runs the CPU tests, pays for every call inside a key loop (a wrapper cost 10-15% of a kernel)."""
    x = tl.load(x_ptr + offsets + d[None, :], mask=mask, other=0.0).to(tl.float32)
    if ROTARY:
        if INTERLEAVED:
            partner = d ^ 1
            sign = tl.where(d % 2 == 0, -1.0, 1.0)
            freq = d // 2
        else:
            partner = tl.where(d < HALF, d + HALF, d - HALF)
            sign = tl.where(d < HALF, -1.0, 1.0)
            freq = d % HALF
        rot = mask & (d < 2 * HALF)[None, :]
        table = positions.to(tl.int64)[:, None] * HALF + freq[None, :]
        cos = tl.load(cos_ptr + table, mask=rot, other=1.0).to(tl.float32)
        sin = tl.load(sin_ptr + table, mask=rot, other=0.0).to(tl.float32)
        other = tl.load(x_ptr + offsets + partner[None, :], mask=rot, other=0.0).to(tl.float32)
        x = x * cos + sign[None, :] * other * sin
    return x


# Whether this process's kernels run under Triton's interpreter: read from how they were made (TRITON_INTERPRET=1
# when plugins/gpu was imported), not from the variable at a launch, which a test module sets after a GPU
# process has compiled them (a GPU test's child process imports the kernels, then the test modules' helpers)
INTERPRETED = type(rows).__name__ == "InterpretedFunction"


@triton.jit
def logits(dots, scale, SOFTCAP: tl.constexpr):
    """The logits of query-key dots in base 2, as every online softmax here keeps them: times `scale` (the softmax
    scale, with an fp8 cache's key scale), capped by SOFTCAP, times log2(e). So the softmax exponentiates with exp2,
    and without a softcap both factors are one multiply (tl.exp multiplies by log2(e) inside: one more an element,
    FlashAttention's own saving). The running maxima, the split merge (split_kv.py) and the sinks (`with_sink`) are
    in the same units."""
    if SOFTCAP > 0:
        s = capped(dots * scale, SOFTCAP) * 1.4426950408889634
    else:
        s = dots * (scale * 1.4426950408889634)
    return s


@triton.jit
def softmax_block(scores, m_i, l_i):
    """One block of keys in an online softmax over rows, its logits in base 2 (`logits`): the block's
    unnormalized probabilities, the factor that rescales what came before, and the new running max and sum
    (fully masked rows stay 0)."""
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(scores - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def fold_keys(acc, m_i, l_i, q, k, v, n, valid, row_ok, pos, k_scale, SCALE: tl.constexpr, SOFTCAP: tl.constexpr,
              WINDOW: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """A block of keys `k` [N, D] and values `v` at positions `n` [N], in the cache's units (fp8.py load_kv: the key
    scale `k_scale` joins the softmax scale on the logits), folded into the online softmax (acc, m_i, l_i) of the
    tile's queries `q`: masked where `valid` [N] or `row_ok` [M] is false, and by the rows' positions `pos` [M] with
    CAUSAL (keys at or before) and WINDOW (within it)."""
    k, v = k.to(q.dtype), v.to(q.dtype)  # exact for an fp8 cache's codes; fp32 under UPCAST
    scores = logits(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION), SCALE * k_scale, SOFTCAP)
    visible = valid[None, :] & row_ok[:, None]
    if CAUSAL:
        visible = visible & (n[None, :] <= pos[:, None])
    if WINDOW > 0:
        visible = visible & (n[None, :] > pos[:, None] - WINDOW)
    p, alpha, m_i, l_i = softmax_block(tl.where(visible, scores, float("-inf")), m_i, l_i)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_i, l_i


@triton.jit
def capped(scores, SOFTCAP: tl.constexpr):
    """softcap * tanh(scores / softcap) when SOFTCAP > 0 (through exp: saturates cleanly at +-softcap)."""
    if SOFTCAP > 0:
        scores = SOFTCAP * (1.0 - 2.0 / (tl.exp(2.0 * scores / SOFTCAP) + 1.0))
    return scores


@triton.jit
def with_sink(acc, m_i, l_i, sink):
    """A finished online softmax (acc [rows, D], running max in base 2 and sum [rows]) with each row's sink logit
    (natural units, as the op's head_sink holds it) joining the denominator: the max taken over both, the values
    rescaled to it. A row that saw nothing keeps acc 0 (its output stays 0); a sink of -inf changes nothing."""
    sink = sink * 1.4426950408889634  # in base 2, as the running max (`logits`)
    top = tl.maximum(m_i, sink)
    top = tl.where(top == float("-inf"), 0.0, top)
    factor = tl.exp2(m_i - top)
    return acc * factor[:, None], l_i * factor + tl.exp2(sink - top)
