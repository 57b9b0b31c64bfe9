"""GPU attention: llmc's slot and paged Triton kernels against torch SDPA, ratios from one run.

    .venv/bin/python -m llmc.bench gpu-kernels [--kind decode|prefill|all|tune] [--batch 32] [--context 4096]
                                               [--tokens 2048] [--cached 0] [--heads 32] [--kv-heads 8]
                                               [--head-dim 128] [--dtype fp16|bf16] [--passes 5] [--sweep]
                                               [--tune-workers 8] [--out FILE]

`--kind tune` (gpu_tune.py): the decode kernels' launch configurations (keys a step, warps, stages, split
count) timed at the sweep's decode shapes, the fastest per kernel and shape.

`--kind prefill` (gpu_prefill.py): one causal prefill of `--tokens` after `--cached` tokens through the paged
prefill kernel, fp16/bf16 and fp8 KV, in TFLOP/s against SDPA; `--sweep` there runs 2k/8k/32k fresh and a 2k
chunk after 2k/8k/32k cached, at head_dim 128 and 256.

Decode (the default kind): one decode step (one new token per row, every row at `context - 1` cached tokens) of:
  - llmc one launch (plugins/gpu/one_launch.py: the TensorRT plugin's kernel),
  - llmc paged, two launches (plugins/gpu/paged_kernels.py: block write + attention) and one launch
    (plugins/gpu/paged_kernels_aot.py), over the same cache laid out as blocks of `--block-size`
    in shuffled order through each row's block table,
  - the one-launch and paged kernels each twice: without key splits (what the TensorRT plugin compiles) and
    with the split-KV count their PyTorch launch picks from the shapes and the GPU's SMs
    (configs.decode_splits; `--splits N` forces N), merged in the same launch (plugins/gpu/split_kv.py),
  - the split forms again over an fp8 (e4m3) cache with per-KV-head scales (plugins/gpu/fp8.py), whose rows give
    their speed against the same kernel's over the fp16/bf16 cache (`vs_16bit`; their TB/s count fp8 bytes),
  - torch SDPA over the same cache (`enable_gqa`; the new token already written, so SDPA does
    less work than the kernels, which also write the cache).
Each is timed with CUDA events (median of `--passes` passes of 50 steps, or of as many as fill 20 ms, after
warm-up); the achieved memory bandwidth counts the KV bytes a step must read (2 x batch x kv_heads x context x
head_dim x size), and its share of the GPU's data-sheet peak is printed beside the ratio to SDPA (`--out FILE`: the
same as JSON, written after every shape, `"complete": false` until the last, so a run stopped by a time limit keeps
what it measured). A kernel that fails (out of shared memory, a compile error) is a row with its error, and a shape
that fails, one entry: the others still run, and the run exits non-zero naming them.
Needs an NVIDIA GPU (the `device` machines have one); refused with a usage message otherwise.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from llmc.bench.harness import UsageError, median, write_json
from llmc.bench.kernels.gpu_prefill import PREFILL_SWEEP, check_kernels, measure_prefill, peak_tflops
from llmc.bench.kernels.gpu_tune import decode_step, default_splits, tune


def _time(fn, torch, passes: int, steps: int = 50, pass_ms: float = 20.0) -> float:
    """Median ms of one call over `passes` passes, each timed with CUDA events around a run of calls: `steps` of
    them, or as many as fill about `pass_ms` when one call is longer (a 32k-token prefill takes tens of ms, and a
    decode kernel run as a prefill tactic far more; fixed 50-call passes of those would take minutes of the GPU
    lease for no better median)."""
    fn()  # compile (and autotune) outside the timings
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    steps = max(1, min(steps, int(pass_ms / max(start.elapsed_time(end), 1e-3))))
    for _ in range(min(steps, 5)):
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
    return median(times)  # ms per step


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kind", choices=("decode", "prefill", "all", "tune"), default="decode",
                   help="tune: the decode kernels' launch configurations timed at the sweep's shapes (gpu_tune.py)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=2048, help="prefill: the prompt (or chunk) length")
    p.add_argument("--cached", type=int, default=0, help="prefill: tokens already in the cache")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--passes", type=int, default=5)
    p.add_argument("--splits", type=int, default=None, help="key splits of the split forms (default: their own)")
    p.add_argument("--sweep", action="store_true", help="issue 55's shapes: decode batch x context 32 x 4k, 8 x "
                   "32k, 64 x 8k and 1 x 128k; prefill 2k/8k/32k fresh and a 2k chunk after 2k/8k/32k cached; each "
                   "at head_dim 128 and 256 (--batch, --context, --tokens, --cached, --head-dim ignored)")
    p.add_argument("--tune-workers", type=int, default=8, help="tune: processes compiling the variants at once")
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here too")


# issue 55's decode shapes (batch, context), each at head_dim 128 and 256: `--sweep` runs them all
SWEEP = [(b, c, d) for d in (128, 256) for b, c in ((32, 4096), (8, 32768), (64, 8192), (1, 131072))]


def run(args: argparse.Namespace) -> None:
    import torch

    if not torch.cuda.is_available():
        raise UsageError("needs an NVIDIA GPU (CUDA); none is visible here")
    device = torch.cuda.get_device_name()
    if args.kind == "tune":
        tune(args, _time, lambda tuned, complete: args.out and write_json(args.out, {
            "device": device, "peak_tb_s": peak_bandwidth(device), "peak_tflops": peak_tflops(device), "kind": "tune",
            "tune": tuned, "complete": complete}))
        return
    decode, prefill = plan(args)
    results, prefills, failed = [], [], []

    def save(complete: bool) -> None:  # after every shape: a run stopped by its time limit keeps what it measured
        if args.out:
            write_json(args.out, {**report(device, args, results, prefills), "complete": complete})

    for rows, shapes, fn in ((results, decode, lambda b, c, d: measure(args, b, c, d)),
                             (prefills, prefill, lambda t, c, d: measure_prefill(args, t, c, d, _time))):
        for shape in shapes:
            try:
                rows.append(fn(*shape))
            except Exception as error:  # noqa: BLE001  (recorded, named at the end; the other shapes still run)
                rows.append({"shape": list(shape), "error": f"{type(error).__name__}: {error}"})
                print(f"shape {shape} failed: {rows[-1]['error']}")
            row = rows[-1]
            failed += [f"{shape}: {row['error']}"] if "error" in row else [
                f"{shape} {name}: {kernel['error']}" for name, kernel in row["kernels"].items() if "error" in kernel]
            save(False)
    save(True)
    if failed:
        raise SystemExit(f"gpu-kernels: {len(failed)} failed (in the JSON as errors): " + "; ".join(failed)[:2000])


def plan(args: argparse.Namespace) -> tuple[list, list]:
    """The decode shapes (batch, context, head_dim) and prefill shapes (tokens, cached, head_dim) to run."""
    decode = SWEEP if args.sweep else [(args.batch, args.context, args.head_dim)]
    prefill = PREFILL_SWEEP if args.sweep else [(args.tokens, args.cached, args.head_dim)]
    return (decode if args.kind in ("decode", "all") else [], prefill if args.kind in ("prefill", "all") else [])


def report(device: str, args: argparse.Namespace, runs: list[dict], prefill: list[dict]) -> dict:
    """The JSON `--out` writes: the GPU and its data-sheet peaks, the decode runs and the prefill runs."""
    return {"device": device, "peak_tb_s": peak_bandwidth(device), "peak_tflops": peak_tflops(device),
            "dtype": args.dtype, "kind": args.kind, "runs": runs, "prefill": prefill}


def measure(args: argparse.Namespace, b: int, c: int, d: int) -> dict:
    """One decode shape: every kernel checked against the reference, timed, printed; its figures returned."""
    import functools

    import torch

    from llmc.plugins.op.attention import reference_attention
    from llmc.plugins.gpu.configs import BLOCK_M, SPLIT_KEYS, decode_splits
    from llmc.plugins.gpu.one_launch import one_launch_attention
    from llmc.plugins.gpu.paged_kernels import paged_attention
    from llmc.plugins.gpu.paged_kernels_aot import paged_attention_one_launch
    from llmc.plugins.gpu.split_kv import num_sms

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    h, kvh, bs = args.heads, args.kv_heads, args.block_size
    if c % bs:
        raise UsageError(f"--context {c} must be a multiple of --block-size {bs}")
    # the slot cache and the same cache as block pools in a shuffled table (gpu_tune.decode_step)
    step = decode_step(b, c, d, h, kvh, dtype, bs)
    q, k, v, kc, vc, pos, scale = step.q, step.k, step.v, step.kc, step.vc, step.pos, step.scale
    ref = reference_attention(q, k, v, kc.clone(), vc.clone(), pos, scale)[0].float()
    # what the split forms' launches pick (gpu_tune.default_splits): slot, a row's group heads in whole tiles; paged,
    # the tiles holding queries (paged_kernels.busy_tiles: a tile a decode row)
    group = h // kvh
    sms = num_sms(q.device)
    picked = default_splits(b, c, h, kvh)
    slot_splits = args.splits or picked["slot one launch"]
    paged_splits = args.splits or picked["paged two launches"]
    # as a TensorRT engine launches them (compiler/tensorrt/split_kv.py): a grid of key_splits (one row at this
    # context) over a workspace of 2 partials an SM, the grid sized from the shapes (split_kv.plugin_splits)
    slots, plugin_splits = 2 * sms, decode_splits(-(-group // BLOCK_M), kvh, c, sms)
    print(f"key splits (min {SPLIT_KEYS} keys each, {sms} SMs): slot {slot_splits}, paged {paged_splits}; "
          f"the plugins' grid {plugin_splits} over {slots} partials")
    kernels = {"llmc one launch": lambda: one_launch_attention(q, k, v, kc, vc, pos, scale, splits=1),
               f"llmc one launch, {slot_splits} splits": lambda: one_launch_attention(q, k, v, kc, vc, pos, scale,
                                                                                      splits=slot_splits),
               "llmc one launch, as the plugin": lambda: one_launch_attention(q, k, v, kc, vc, pos, scale,
                                                                              splits=plugin_splits, slots=slots)}
    plugin = functools.partial(paged_attention_one_launch, slots=slots)
    for name, kernel, splits in (("llmc paged two launches", paged_attention, 1),
                                 (f"llmc paged two launches, {paged_splits} splits", paged_attention, paged_splits),
                                 ("llmc paged one launch", paged_attention_one_launch, 1),
                                 (f"llmc paged one launch, {paged_splits} splits", paged_attention_one_launch,
                                  paged_splits),
                                 ("llmc paged one launch, as the plugin", plugin, plugin_splits)):
        kernels[name] = (lambda kernel=kernel, splits=splits: kernel(**step.paged, splits=splits)[0].view(b, 1, h, d))
    # the same caches in fp8 (e4m3) with one scale per KV head: the split forms, against their 16-bit rows
    scales = torch.full((kvh,), 1 / 64, device="cuda")  # randn / (1/64) stays within e4m3's 448
    kc8, vc8 = ((t.float() / scales.view(1, -1, 1, 1)).to(torch.float8_e4m3fn) for t in (kc, vc))  # [B, KVH, C, D]
    paged8 = {**step.paged, **{n: (step.paged[n].float() / scales.view(1, 1, -1, 1)).to(torch.float8_e4m3fn)
                               for n in ("key_cache", "value_cache")}}  # [N, bs, KVH, D]
    ref8 = reference_attention(q, k, v, kc8.clone(), vc8.clone(), pos, scale, k_scale=scales, v_scale=scales)[0].float()
    fp8 = {f"llmc one launch, {slot_splits} splits, fp8 KV": (f"llmc one launch, {slot_splits} splits", lambda:
           one_launch_attention(q, k, v, kc8, vc8, pos, scale, splits=slot_splits, k_scale=scales, v_scale=scales))}
    for name, kernel in ((f"llmc paged two launches, {paged_splits} splits", paged_attention),
                         (f"llmc paged one launch, {paged_splits} splits", paged_attention_one_launch)):
        fp8[name + ", fp8 KV"] = (name, lambda kernel=kernel: kernel(
            **paged8, splits=paged_splits, k_scale=scales, v_scale=scales)[0].view(b, 1, h, d))
    failed = check_kernels(kernels, ref)
    fp8_runs = {name: run for name, (_, run) in fp8.items()}
    failed |= check_kernels(fp8_runs, ref8, "reference over the same fp8 cache")
    fp8 = {name: fp8[name] for name in fp8_runs}
    kernels.update(fp8_runs)
    qs = q.transpose(1, 2)  # [B, H, 1, D]; SDPA over the full cache, GQA read once per KV head

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(qs, kc, vc, scale=scale, enable_gqa=True)

    timings = {"torch SDPA": _time(sdpa, torch, args.passes)}
    for name, run in kernels.items():
        timings[name] = _time(run, torch, args.passes)
    kv_bytes = 2 * b * kvh * c * d * q.element_size()
    device = torch.cuda.get_device_name()
    rows = summarize(timings, kv_bytes, device, {name: kv_bytes // q.element_size() for name in fp8})
    for name, (same, _) in fp8.items():
        if same in rows:
            rows[name]["vs_16bit"] = rows[same]["ms"] / rows[name]["ms"]
    print(f"\ndecode step, batch {b}, context {c}, heads {h}/{kvh}, head_dim {d}, {args.dtype} on {device}")
    print(f"{'kernel':36} {'ms/step':>8} {'TB/s (KV read)':>15} {'of peak':>8} {'vs SDPA':>8}")
    for name, row in rows.items():
        share = f"{row['peak_share']:7.0%}" if row["peak_share"] is not None else "      ?"
        print(f"{name:36} {row['ms']:8.3f} {row['tb_s']:15.2f} {share:>8} {row['vs_sdpa']:7.2f}x")
    shape = {"batch": b, "context": c, "heads": h, "kv_heads": kvh, "head_dim": d, "dtype": args.dtype,
             "block_size": bs, "splits": {"slot": slot_splits, "paged": paged_splits, "plugin_grid": plugin_splits,
                                          "plugin_slots": slots}, "passes": args.passes}
    return {"shape": shape, "kernels": {**rows, **failed}}


# HBM bandwidth by GPU, TB/s (the vendors' data sheets): a kernel's share of it is how close to the roofline a
# decode step runs. A GPU not listed gets no share (None), never a guessed one.
PEAK_TB_S = {"H200": 4.8, "H100 SXM": 3.35, "H100 NVL": 3.9, "H100 PCIe": 2.0, "A100-SXM4-80GB": 2.039,
             "A100-PCIE-80GB": 1.935, "A100-SXM4-40GB": 1.555, "L40S": 0.864, "L4": 0.3}


def peak_bandwidth(device: str) -> float | None:
    """The data sheet's HBM bandwidth of the GPU `torch.cuda.get_device_name()` names, None when unknown (the
    longest matching key wins: "H100 NVL" before "H100")."""
    found = [key for key in PEAK_TB_S if key.replace(" ", "").lower() in device.replace(" ", "").lower()]
    return PEAK_TB_S[max(found, key=len)] if found else None


def summarize(timings: dict[str, float], kv_bytes: int, device: str,
              bytes_by_name: dict[str, int] | None = None) -> dict[str, dict]:
    """Each kernel's ms a step, the KV bytes a step must read over that time (TB/s; `bytes_by_name` for kernels
    reading other than `kv_bytes`: an fp8 cache), its share of the GPU's peak bandwidth (None for an unknown GPU)
    and its speed against torch SDPA's from the same run."""
    peak = peak_bandwidth(device)
    sdpa = timings["torch SDPA"]
    out = {}
    for name, ms in timings.items():
        tb_s = (bytes_by_name or {}).get(name, kv_bytes) / (ms * 1e-3) / 1e12
        out[name] = {"ms": ms, "tb_s": tb_s, "peak_share": tb_s / peak if peak else None, "vs_sdpa": sdpa / ms}
    return out
