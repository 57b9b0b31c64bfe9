"""GPU prefill attention: llmc's paged prefill kernel (plugins/gpu/prefill.py) against torch SDPA, for
`python -m llmc.bench gpu-kernels --kind prefill` (gpu.py holds the command and the decode rows).

One causal prefill of one sequence, `heads` query heads over `kv_heads` KV heads: fresh (a prompt of `tokens`,
nothing cached) or a chunk of `tokens` queries after `cached` tokens already in the paged cache. The llmc row
times the whole op as the engine would run it (the chunk's keys and values written into their blocks, then the
attention); SDPA gets the cache as one contiguous tensor with the chunk already in it (`enable_gqa`; a chunk
after cached tokens with a lower-right causal mask). Throughput counts the multiply-adds the causal mask leaves
(4 x heads x head_dim per visible (query, key) pair), and its share of the GPU's data-sheet dense fp16/bf16
peak is printed beside the ratio to SDPA from the same run. The kernel's output is checked against SDPA's.

The TensorRT plugin's two tactics run too, over a slot cache holding the same cached tokens: its prefill kernel
(plugins/gpu/slot_prefill.py, in the tiles the plugin's compile picks for this head size) and its one-launch
kernel (the decode tactic), so a GPU session sees what TensorRT chooses between for the prefill profile.
"""

from __future__ import annotations

# issue 55's prefill shapes: (tokens, cached) at 2k, 8k and 32k, fresh and as a 2k chunk after that many cached
PREFILL_SWEEP = [(t, 0, d) for d in (128, 256) for t in (2048, 8192, 32768)] + \
    [(2048, c, d) for d in (128, 256) for c in (2048, 8192, 32768)]

# dense fp16/bf16 tensor-core TFLOP/s by GPU (the vendors' data sheets, without sparsity); None when unlisted
PEAK_TFLOPS = {"H200": 989.0, "H100 SXM": 989.0, "H100 NVL": 835.0, "H100 PCIe": 756.0, "A100": 312.0,
               "L40S": 362.0, "L4": 121.0}


def peak_tflops(device: str) -> float | None:
    """The data sheet's dense fp16 TFLOP/s of the GPU `device` names (the longest matching key), None when
    unknown."""
    found = [key for key in PEAK_TFLOPS if key.replace(" ", "").lower() in device.replace(" ", "").lower()]
    return PEAK_TFLOPS[max(found, key=len)] if found else None


def prefill_flops(tokens: int, cached: int, heads: int, head_dim: int) -> int:
    """Floating-point operations of a causal prefill of `tokens` queries after `cached` keys: two matmuls of 2
    operations a multiply-add over every visible (query, key) pair (query i sees cached + i + 1 keys)."""
    pairs = tokens * cached + tokens * (tokens + 1) // 2
    return 4 * heads * head_dim * pairs


def summarize_prefill(timings: dict[str, float], flops: int, device: str) -> dict[str, dict]:
    """Each kernel's ms, TFLOP/s, share of the GPU's peak (None for an unknown GPU) and speed against SDPA's."""
    peak = peak_tflops(device)
    sdpa = timings["torch SDPA"]
    out = {}
    for name, ms in timings.items():
        tflops = flops / (ms * 1e-3) / 1e12
        out[name] = {"ms": ms, "tflops": tflops, "peak_share": tflops / peak if peak else None, "vs_sdpa": sdpa / ms}
    return out


def check_kernels(kernels: dict, ref, against: str = "reference") -> dict[str, dict]:
    """Run each kernel once and print its largest error against `ref`. A kernel that raises (out of shared memory,
    a compile error) leaves `kernels`, so the shape's others are still timed; its error is returned by name as a
    row of the table."""
    failed = {}
    for name in list(kernels):
        try:
            err = (kernels[name]().float() - ref).abs().max().item()
        except Exception as error:  # noqa: BLE001  (a row of the JSON)
            failed[name] = {"error": f"{type(error).__name__}: {error}"}
            del kernels[name]
            print(f"{name}: FAILED, {failed[name]['error']}")
            continue
        print(f"{name}: max |error| vs {against} {err:.2e}")
    return failed


def measure_prefill(args, tokens: int, cached: int, d: int, time_fn) -> dict:
    """One prefill shape on the GPU: llmc's paged prefill (fp16/bf16 cache, and fp8 with per-head scales) and
    SDPA, checked, timed by `time_fn(fn, torch, passes)` (ms), printed; its figures returned."""
    import torch
    from torch.nn.attention.bias import causal_lower_right

    from llmc.plugins.gpu.prefill import paged_prefill

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    h, kvh, bs = args.heads, args.kv_heads, args.block_size
    total = cached + tokens
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(tokens, h * d, device="cuda", dtype=dtype, generator=g)
    k, v = (torch.randn(tokens, kvh * d, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    past_k, past_v = (torch.randn(cached, kvh, d, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    blocks = -(-total // bs)
    table = torch.randperm(blocks, device="cuda", generator=g).view(1, blocks).to(torch.int32)

    def pool(past, cache_dtype=dtype, scale=None):  # the cached tokens in shuffled blocks
        flat = torch.zeros(blocks * bs, kvh, d, device="cuda", dtype=torch.float32)
        order = (table[0].long()[:, None] * bs + torch.arange(bs, device="cuda")).flatten()[:cached]
        flat[order] = past.float() / (scale[None, :, None] if scale is not None else 1)
        return flat.view(blocks, bs, kvh, d).to(cache_dtype)

    step = {"query": q, "key": k, "value": v, "cumulative_sequence_length": torch.tensor([0, tokens], device="cuda",
                                                                                          dtype=torch.int32),
            "past_seqlens": torch.tensor([cached], device="cuda", dtype=torch.int32), "block_table": table,
            "num_heads": h, "kv_num_heads": kvh, "scale": d ** -0.5}
    kc, vc = pool(past_k), pool(past_v)
    scales = torch.full((kvh,), 1 / 64, device="cuda")  # randn / (1/64) stays within e4m3's 448
    kc8, vc8 = pool(past_k, torch.float8_e4m3fn, scales), pool(past_v, torch.float8_e4m3fn, scales)
    kernels = {"llmc paged prefill": lambda: paged_prefill(**step, key_cache=kc, value_cache=vc)[0],
               "llmc paged prefill, fp8 KV": lambda: paged_prefill(**step, key_cache=kc8, value_cache=vc8,
                                                                   k_scale=scales, v_scale=scales)[0]}
    kernels.update(_plugin_tactics(q, k, v, past_k, past_v, h, kvh, d, cached, tokens, args.dtype))
    keys = torch.cat([past_k, k.view(tokens, kvh, d)]).transpose(0, 1)[None]  # [1, KVH, total, D]
    values = torch.cat([past_v, v.view(tokens, kvh, d)]).transpose(0, 1)[None]
    qs = q.view(1, tokens, h, d).transpose(1, 2)
    mask = causal_lower_right(tokens, total) if cached else None

    def sdpa():
        if mask is None:
            return torch.nn.functional.scaled_dot_product_attention(qs, keys, values, is_causal=True, enable_gqa=True)
        return torch.nn.functional.scaled_dot_product_attention(qs, keys, values, attn_mask=mask, enable_gqa=True)

    want = sdpa().transpose(1, 2).reshape(tokens, h * d).float()
    failed = check_kernels(kernels, want, "SDPA")
    timings = {"torch SDPA": time_fn(sdpa, torch, args.passes)}
    timings.update({name: time_fn(run, torch, args.passes) for name, run in kernels.items()})
    device = torch.cuda.get_device_name()
    rows = summarize_prefill(timings, prefill_flops(tokens, cached, h, d), device)
    print(f"\ncausal prefill, {tokens} tokens after {cached} cached, heads {h}/{kvh}, head_dim {d}, {args.dtype} "
          f"on {device}")
    print(f"{'kernel':52} {'ms':>9} {'TFLOP/s':>9} {'of peak':>8} {'vs SDPA':>8}")
    for name, row in rows.items():
        share = f"{row['peak_share']:7.0%}" if row["peak_share"] is not None else "      ?"
        print(f"{name:52} {row['ms']:9.3f} {row['tflops']:9.1f} {share:>8} {row['vs_sdpa']:7.2f}x")
    shape = {"tokens": tokens, "cached": cached, "heads": h, "kv_heads": kvh, "head_dim": d, "dtype": args.dtype,
             "block_size": bs, "passes": args.passes}
    return {"shape": shape, "kernels": {**rows, **failed}}


def _plugin_tactics(q, k, v, past_k, past_v, h: int, kvh: int, d: int, cached: int, tokens: int, dtype: str) -> dict:
    """The TensorRT plugin's tactics over a slot cache of one row (the cached tokens, room for the new ones), each
    returning the output as [tokens, h * d]: the prefill kernel in the tiles plugin_prefill_kernel picks for this
    GPU and head size, and the one-launch kernel unsplit."""
    import torch

    from llmc.plugins.gpu.kernels_aot import plugin_prefill_kernel
    from llmc.plugins.gpu.one_launch import one_launch_attention
    from llmc.plugins.gpu.slot_prefill import PLUGIN_PREFILL_CONFIGS, slot_prefill

    major, minor = torch.cuda.get_device_capability()
    rows = plugin_prefill_kernel(h, kvh, d, d ** -0.5, dtype, 10 * major + minor, rotary=False).block_m
    config = next(c for c in PLUGIN_PREFILL_CONFIGS if c.block_m == rows)
    kc, vc = (torch.zeros(1, kvh, cached + tokens, d, device="cuda", dtype=q.dtype) for _ in range(2))
    kc[0, :, :cached], vc[0, :, :cached] = past_k.transpose(0, 1), past_v.transpose(0, 1)
    qs, ks, vs = q.view(1, tokens, h, d), k.view(1, tokens, kvh, d), v.view(1, tokens, kvh, d)
    pos = torch.tensor([cached], device="cuda")
    return {f"llmc slot prefill (plugin tactic, {config.block_m}x{config.block_n})":
            lambda: slot_prefill(qs, ks, vs, kc, vc, pos, d ** -0.5, config=config).view(tokens, h * d),
            "llmc one launch (plugin decode tactic)":
            lambda: one_launch_attention(qs, ks, vs, kc, vc, pos, d ** -0.5, splits=1).view(tokens, h * d)}
