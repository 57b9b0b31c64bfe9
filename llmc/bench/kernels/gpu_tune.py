"""The attention kernels' launch configurations, timed on a GPU: `python -m llmc.bench gpu-kernels --kind tune`.

configs.attention_config's portable rule gives every decode kernel 32 keys a step and 4 warps, a choice made
without a GPU; this run's fastest on an H200 became Hopper's (configs.HOPPER_DECODE). It times:
  - decode, at issue 55's shapes (batch x context 32 x 4k, 8 x 32k, 64 x 8k, 1 x 128k; `--head-dim`, default
    128): keys a step 32/64/128, with 4 warps over 3 or 5 stages or 8 warps over 5, each at the split count the
    launch picks and at twice it, for the slot kernel in one launch and the paged kernel in two launches and in one
    (the paged kernel that reads only the cache overlaps its loads from 5 stages on, configs.TABLE_STAGES: its 3
    and 4 compile to the same loop, so the first run's 4-stage variants timed nothing new for it);
  - prefill, 8k fresh and a 2k chunk after 8k cached: the paged prefill kernel and the plugin's slot prefill in
    each of PREFILL_TILES (configs.PREFILL_CONFIGS' Hopper list, and the 3-stage tiles timed before).
Every variant is checked against the reference before it is timed; its step time, KV bandwidth (decode) or
TFLOP/s (prefill) and ratio to torch SDPA from the same run are printed and written (`--out`), with the fastest
per kernel and shape.

Compiling the ~150 variants one at a time would use most of a device lease, so they are compiled first by
`--tune-workers` processes at once (each runs its share once, at the same shapes, which fills Triton's on-disk
cache); the timing then runs in this process alone, from that cache.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
from types import SimpleNamespace

from llmc.bench.kernels.gpu_prefill import prefill_flops
from llmc.plugins.gpu.configs import BLOCK_M, PREFILL_CONFIGS, TABLE_STAGES, KernelConfig

TUNE_SHAPES = ((32, 4096), (8, 32768), (64, 8192), (1, 131072))
TUNE_CONFIGS = tuple(KernelConfig(BLOCK_M, n, w, s) for n in (32, 64, 128)
                     for w, s in ((4, 3), (4, TABLE_STAGES), (8, TABLE_STAGES)))
KERNELS = ("slot one launch", "paged two launches", "paged one launch")
PREFILL_SHAPES = ((8192, 0), (2048, 8192))  # (tokens, cached)
PREFILL_TILES = (*PREFILL_CONFIGS[90][:-1], KernelConfig(128, 64, 4, TABLE_STAGES), KernelConfig(128, 32, 4, 3),
                 KernelConfig(64, 64, 4, 3))
PREFILL_KERNELS = ("paged prefill", "slot prefill")


def label(config: KernelConfig) -> str:
    return f"{config.block_m}x{config.block_n}, {config.num_warps} warps, {config.num_stages} stages"


def decode_step(batch: int, context: int, head_dim: int, heads: int, kv_heads: int, dtype, block_size: int):
    """One decode step's tensors, shared by this tuning and gpu.measure: queries and new keys/values for `batch`
    rows at position `context - 1`, a slot cache [B, KVH, C, D] of random (stale) entries, the same cache as block
    pools of `block_size` in a shuffled block table (row r's position t in block table[r, t // bs] at offset
    t % bs), and the paged launch's keyword arguments over them (`paged`, without splits)."""
    import torch

    b, c, d, h, kvh = batch, context, head_dim, heads, kv_heads
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, 1, h, d, device="cuda", dtype=dtype, generator=g)
    k, v = (torch.randn(b, 1, kvh, d, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    kc, vc = (torch.randn(b, kvh, c, d, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    pos = torch.full((b,), c - 1, device="cuda", dtype=torch.int64)
    scale = d ** -0.5
    per_row = c // block_size
    table = torch.randperm(b * per_row, device="cuda", generator=g).view(b, per_row).to(torch.int32)

    def pool(cache):  # [B, KVH, C, D] -> [blocks, bs, KVH, D] in the table's (shuffled) order
        blocks = torch.empty(b * per_row, block_size, kvh, d, device="cuda", dtype=dtype)
        blocks[table.flatten().long()] = cache.permute(0, 2, 1, 3).reshape(b * per_row, block_size, kvh, d)
        return blocks

    kp, vp = pool(kc), pool(vc)
    paged = {"query": q.reshape(b, h * d), "key": k.reshape(b, kvh * d), "value": v.reshape(b, kvh * d),
             "key_cache": kp, "value_cache": vp, "cumulative_sequence_length": torch.arange(b + 1, device="cuda",
                                                                                            dtype=torch.int32),
             "past_seqlens": pos.to(torch.int32), "block_table": table, "num_heads": h, "kv_num_heads": kvh,
             "scale": scale}
    return SimpleNamespace(q=q, k=k, v=v, kc=kc, vc=vc, pos=pos, scale=scale, paged=paged)


def decode_case(batch: int, context: int, head_dim: int, heads: int, kv_heads: int, dtype_name: str,
                block_size: int, reference: bool = True):
    """One decode step (decode_step), the reference output (None without `reference`: its fp32 copies of the
    cache, repeated per query head, take 17 GB at 64 x 8k), SDPA, and a run function `run(kernel, config, splits)`
    for each of KERNELS; plus each kernel's default split count."""
    import torch

    from llmc.plugins.gpu.one_launch import one_launch_attention
    from llmc.plugins.gpu.paged_kernels import paged_attention
    from llmc.plugins.gpu.paged_kernels_aot import paged_attention_one_launch
    from llmc.plugins.op.attention import reference_attention

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype_name]
    b, h, d = batch, heads, head_dim
    t = decode_step(batch, context, head_dim, heads, kv_heads, dtype, block_size)
    q, k, v, kc, vc, pos, scale = t.q, t.k, t.v, t.kc, t.vc, t.pos, t.scale
    ref = reference_attention(q, k, v, kc.clone(), vc.clone(), pos, scale)[0].float() if reference else None
    defaults = default_splits(b, context, h, kv_heads)

    def run(kernel: str, config: KernelConfig, splits: int):
        if kernel == "slot one launch":
            return one_launch_attention(q, k, v, kc, vc, pos, scale, splits=splits, config=config)
        launch = paged_attention if kernel == "paged two launches" else paged_attention_one_launch
        return launch(**t.paged, splits=splits, config=config)[0].view(b, 1, h, d)

    qs = q.transpose(1, 2)

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(qs, kc, vc, scale=scale, enable_gqa=True)

    kv_bytes = 2 * b * kv_heads * context * d * q.element_size()
    return run, ref, sdpa, defaults, kv_bytes


def prefill_case(tokens: int, cached: int, head_dim: int, heads: int, kv_heads: int, dtype_name: str,
                 block_size: int, reference: bool = True):
    """One causal prefill's tensors (as gpu_prefill.measure_prefill builds them): SDPA's output as the reference,
    SDPA, and `run(kernel, config, splits)` for each of PREFILL_KERNELS (splits unused)."""
    import torch
    from torch.nn.attention.bias import causal_lower_right

    from llmc.plugins.gpu.prefill import paged_prefill
    from llmc.plugins.gpu.slot_prefill import slot_prefill

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype_name]
    h, kvh, d, total = heads, kv_heads, head_dim, cached + tokens
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(tokens, h, d, device="cuda", dtype=dtype, generator=g)
    k, v = (torch.randn(tokens, kvh, d, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    past_k, past_v = (torch.randn(cached, kvh, d, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    blocks = -(-total // block_size)
    table = torch.randperm(blocks, device="cuda", generator=g).view(1, blocks).to(torch.int32)
    order = (table[0].long()[:, None] * block_size + torch.arange(block_size, device="cuda")).flatten()[:cached]
    pools = []
    for past in (past_k, past_v):
        flat = torch.zeros(blocks * block_size, kvh, d, device="cuda", dtype=dtype)
        flat[order] = past
        pools.append(flat.view(blocks, block_size, kvh, d))
    slot_k, slot_v = (torch.cat([p, torch.zeros_like(n)]).transpose(0, 1)[None].contiguous()
                      for p, n in ((past_k, k), (past_v, v)))  # [1, KVH, total, D], room for the chunk
    keys, values = (torch.cat([p, n]).transpose(0, 1)[None] for p, n in ((past_k, k), (past_v, v)))
    qs = q[None].transpose(1, 2)
    mask = causal_lower_right(tokens, total) if cached else None

    def sdpa():
        if mask is None:
            return torch.nn.functional.scaled_dot_product_attention(qs, keys, values, is_causal=True, enable_gqa=True)
        return torch.nn.functional.scaled_dot_product_attention(qs, keys, values, attn_mask=mask, enable_gqa=True)

    ref = sdpa().transpose(1, 2).reshape(tokens, h, d).float()
    step = {"query": q.view(tokens, h * d), "key": k.view(tokens, kvh * d), "value": v.view(tokens, kvh * d),
            "key_cache": pools[0], "value_cache": pools[1],
            "cumulative_sequence_length": torch.tensor([0, tokens], device="cuda", dtype=torch.int32),
            "past_seqlens": torch.tensor([cached], device="cuda", dtype=torch.int32), "block_table": table,
            "num_heads": h, "kv_num_heads": kvh, "scale": d ** -0.5}
    position = torch.tensor([cached], device="cuda")

    def run(kernel: str, config: KernelConfig, splits: int):
        if kernel == "paged prefill":
            return paged_prefill(**step, config=config)[0].view(tokens, h, d)
        return slot_prefill(q[None], k[None], v[None], slot_k, slot_v, position, d ** -0.5, config=config)[0]

    return run, ref, sdpa, {kernel: 1 for kernel in PREFILL_KERNELS}, prefill_flops(tokens, cached, h, d)


def variants(defaults: dict[str, int], context: int) -> list[tuple[str, KernelConfig, int]]:
    """(kernel, config, splits) to time at one decode shape (`context` keys; prefill shapes, context 0: every
    prefill kernel in every PREFILL_TILES): every config at the kernel's default split count and at twice it
    (while a split keeps at least one block of the widest config's keys)."""
    if not context:
        return [(kernel, config, 1) for kernel in PREFILL_KERNELS for config in PREFILL_TILES]
    out = []
    for kernel in KERNELS:
        counts = sorted({defaults[kernel], min(2 * defaults[kernel], max(1, context // 128))})
        out += [(kernel, config, splits) for config in TUNE_CONFIGS for splits in counts]
    return out


def cases() -> list[tuple[str, tuple[int, int]]]:
    """Every shape tuned, in order: ("decode", (batch, context)) and ("prefill", (tokens, cached))."""
    return [("decode", shape) for shape in TUNE_SHAPES] + [("prefill", shape) for shape in PREFILL_SHAPES]


def build(case: tuple[str, tuple[int, int]], args: argparse.Namespace, reference: bool = True):
    """(run, reference, sdpa, default splits, work) of one case: KV bytes a decode step reads, or prefill FLOPs."""
    kind, (x, y) = case
    make = decode_case if kind == "decode" else prefill_case
    return make(x, y, args.head_dim, args.heads, args.kv_heads, args.dtype, args.block_size, reference)


def shape_variants(case: tuple[str, tuple[int, int]], args: argparse.Namespace) -> list[tuple[str, KernelConfig, int]]:
    kind, (x, y) = case
    return variants(default_splits(x, y, args.heads, args.kv_heads), y) if kind == "decode" else variants({}, 0)


def _compile_share(args: argparse.Namespace, share: list[tuple[int, int]]) -> list[str]:
    """In a worker process: each (case, variant) of `share` run once, compiled into Triton's cache; the errors."""
    errors, built = [], {}
    for case_index, variant_index in share:
        case = cases()[case_index]
        if case_index not in built:
            built = {case_index: build(case, args, reference=False)}  # one case's tensors at a time
        kernel, config, splits = shape_variants(case, args)[variant_index]
        try:
            built[case_index][0](kernel, config, splits)
        except Exception as error:  # noqa: BLE001  (reported; the timing phase records it per variant)
            errors.append(f"{case} {kernel} {label(config)}, {splits} splits: {type(error).__name__}: {error}")
    return errors


def tune(args: argparse.Namespace, time_fn, save=lambda results, complete: None) -> list[dict]:
    """Every variant at every shape: compiled by worker processes, then checked and timed here (`time_fn(fn,
    torch, passes)` ms). One entry per shape: each variant's figures and the fastest per kernel; `save(results,
    complete)` after each (a run stopped by a time limit keeps what it measured)."""
    import torch

    from llmc.bench.kernels.gpu_prefill import check_kernels

    jobs = [(i, j) for i, case in enumerate(cases()) for j in range(len(shape_variants(case, args)))]
    shares = [jobs[i::args.tune_workers] for i in range(args.tune_workers)]
    context = multiprocessing.get_context("spawn")  # CUDA in each worker: not forked from a CUDA process
    with concurrent.futures.ProcessPoolExecutor(args.tune_workers, mp_context=context) as pool:
        for errors in pool.map(_compile_share, [args] * len(shares), shares):
            for error in errors:
                print("compile:", error[:300])
    results = []
    for case in cases():
        kind, shape = case
        run, ref, sdpa, defaults, work = build(case, args)
        named = {f"{kernel} | {label(config)} | {splits} splits": (lambda kernel=kernel, config=config, splits=splits:
                                                                   run(kernel, config, splits))
                 for kernel, config, splits in shape_variants(case, args)}
        failed = check_kernels(named, ref)
        sdpa_ms = time_fn(sdpa, torch, args.passes)
        rate, unit = ("tb_s", "TB/s") if kind == "decode" else ("tflops", "TFLOP/s")
        rows = {name: {"ms": (ms := time_fn(fn, torch, args.passes)), rate: work / (ms * 1e-3) / 1e12,
                       "vs_sdpa": sdpa_ms / ms} for name, fn in named.items()}
        best = {}
        for kernel in KERNELS + PREFILL_KERNELS:
            mine = {name: row for name, row in rows.items() if name.startswith(kernel + " |")}
            if mine:
                name = min(mine, key=lambda n: mine[n]["ms"])
                best[kernel] = {"variant": name, **mine[name]}
        print(f"\n{kind} tuning, {shape}, head_dim {args.head_dim}, {args.dtype}: SDPA {sdpa_ms:.3f} ms, "
              f"{work / (sdpa_ms * 1e-3) / 1e12:.2f} {unit}")
        for name, row in sorted(rows.items(), key=lambda item: item[1]["ms"]):
            print(f"  {name:64} {row['ms']:8.3f} ms {row[rate]:7.2f} {unit} {row['vs_sdpa']:5.2f}x")
        results.append({"kind": kind, "shape": list(shape), "head_dim": args.head_dim, "dtype": args.dtype,
                        "sdpa_ms": sdpa_ms, "defaults": defaults, "variants": {**rows, **failed}, "best": best})
        save(results, False)
        del run, ref, sdpa
        torch.cuda.empty_cache()
    save(results, True)
    return results


def default_splits(batch: int, context: int, heads: int, kv_heads: int) -> dict[str, int]:
    """Each kernel's split count at a shape when its launch picks (as gpu.measure counts them): from the shapes and
    the GPU's SMs alone."""
    import torch

    from llmc.plugins.gpu.configs import decode_splits
    from llmc.plugins.gpu.paged_kernels import busy_tiles
    from llmc.plugins.gpu.split_kv import num_sms

    group, sms = heads // kv_heads, num_sms(torch.device("cuda"))
    paged = decode_splits(busy_tiles(batch, batch, heads, kv_heads), kv_heads, context, sms)
    return {"slot one launch": decode_splits(batch * -(-group // BLOCK_M), kv_heads, context, sms),
            "paged two launches": paged, "paged one launch": paged}
