"""GPU decode-attention benchmark: llmc's Triton kernels against torch SDPA, ratios from one run.

    .venv/bin/python scripts/bench_kernels.py [--batch 32] [--context 4096] [--heads 32] [--kv-heads 8]
                                             [--head-dim 128] [--dtype fp16] [--passes 5]

One decode step (one new token per row, every row at `context - 1` cached tokens) of:
  - llmc three launches (plugins/gpu/kernels.py: rope/cache write + split-KV decode + merge),
  - llmc one launch (plugins/gpu/kernels_aot.py: the TensorRT plugin's kernel),
  - torch SDPA over the same cache (`enable_gqa`; the new token already written, so SDPA does
    less work than the kernels, which also write the cache).
Each is timed with CUDA events (median of `--passes` x 50 steps after warm-up); the achieved memory
bandwidth counts the KV bytes a step must read (2 x batch x kv_heads x context x head_dim x size).
Needs an NVIDIA GPU (the `device` machines have one); exits with a message otherwise.
"""

from __future__ import annotations

import argparse
import statistics
import sys


def _time(fn, torch, passes: int, steps: int = 50) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(passes):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / steps)
    return statistics.median(times)  # ms per step


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16")
    p.add_argument("--passes", type=int, default=5)
    args = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("bench_kernels: needs an NVIDIA GPU (CUDA); none is visible here", file=sys.stderr)
        return 2
    from llmc.plugins.op.attention import reference_attention
    from llmc.plugins.gpu.kernels import fused_attention
    from llmc.plugins.gpu.kernels_aot import one_launch_attention

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    b, c, h, kvh, d = args.batch, args.context, args.heads, args.kv_heads, args.head_dim
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, 1, h, d, device="cuda", dtype=dtype, generator=g)
    k, v = (torch.randn(b, 1, kvh, d, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    kc, vc = (torch.randn(b, kvh, c, d, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    pos = torch.full((b,), c - 1, device="cuda", dtype=torch.int64)
    scale = d ** -0.5
    ref = reference_attention(q, k, v, kc.clone(), vc.clone(), pos, scale)[0].float()
    kernels = {"llmc three launches": fused_attention, "llmc one launch": one_launch_attention}
    for name, kernel in kernels.items():
        err = (kernel(q, k, v, kc, vc, pos, scale).float() - ref).abs().max().item()
        print(f"{name}: max |error| vs reference {err:.2e}")
    qs = q.transpose(1, 2)  # [B, H, 1, D]; SDPA over the full cache, GQA read once per KV head

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(qs, kc, vc, scale=scale, enable_gqa=True)

    timings = {"torch SDPA": _time(sdpa, torch, args.passes)}
    for name, kernel in kernels.items():
        timings[name] = _time(lambda kernel=kernel: kernel(q, k, v, kc, vc, pos, scale), torch, args.passes)
    kv_bytes = 2 * b * kvh * c * d * q.element_size()
    print(f"\ndecode step, batch {b}, context {c}, heads {h}/{kvh}, head_dim {d}, {args.dtype} "
          f"on {torch.cuda.get_device_name()}")
    print(f"{'kernel':22} {'ms/step':>8} {'GB/s (KV read)':>15} {'vs SDPA':>8}")
    for name, ms in timings.items():
        print(f"{name:22} {ms:8.3f} {kv_bytes / ms / 1e6:15.0f} {timings['torch SDPA'] / ms:7.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
