"""LoRA adapters on SmolLM2 (issue 54's targets): rank-16 adapters on every attention and MLP projection, in process,
the paged fp32 graph, 2 ONNX Runtime threads, greedy.

On a mixture (--checkpoint a Mixtral, Qwen3-MoE or gpt-oss) the adapters also target the experts' gate_up_proj and
down_proj (PEFT's target_parameters), which the LoRA graph serves by recomputing each layer for the adapter tokens
(compiler/lora/experts.py).

One build with --adapters PEFT adapters (random A and B, made by PEFT on the checkpoint) and lora.max_host_adapters
--held. Each pass runs every contender once, in an order that turns pass by pass (harness.in_turn); throughput is
generated tokens over the wall time of --streams requests sent at once (--prompt-tokens + --new-tokens each, every
prompt its own: no prefix hits); ratios are medians of per-pass ratios.

    base           a runner without the LoRA graph (what a build without adapters serves), base-only traffic
                   (`resident_at_open`: what each engine added to the resident set when it opened, and the enabled
                   engine's sessions: one where the sites run fused, two otherwise)
    base_enabled   the adapter-enabled engine, base-only traffic (target >= 0.95x base)
    one_adapter    every request on the same adapter
    four_adapters  every request on one of 4 adapters, round robin (target >= 0.8x base, <= 5% below one_adapter)

On a host whose load swings (single passes of one contender 45-167 tok/s on a shared 2-core host), passes a
contender apart do not compare; so each pass also runs the base engine in lockstep with the adapter-enabled engine
under each other contender's traffic (`lockstep`): both engines' requests sent at once, then one step of each in
turn, each engine's tok/s over its own steps' time. A load change then slows both alike, and the ratios
(`lockstep.ratios`) are medians of per-pass ratios over steps interleaved within milliseconds.

Then, once: --held adapters loaded at run time through the serving loop's control requests (runtime/serving/
lora_admin.py) and held in host memory at once (their bytes); one more adapter from its PEFT folder on disk until it
serves (converted in a process of its own, as `llmc adapters load` does, then loaded; target < 1 s at 0.5B rank 16),
and the first request's TTFT on it against a warm adapter's (target <= 1.2x), medians over --passes.

    .venv/bin/python -m llmc.bench lora [--passes 3] [--streams 16] [--held 32] [--checkpoint DIR] [--mode int4-weight-only]
    .venv/bin/python -m llmc.bench lora --loading-only ...      # only the held adapters, the load and the TTFTs
    LLMC_LORA_FUSION=0 .venv/bin/python -m llmc.bench lora ...   # the four-node branch instead of llmc.LoraDelta
Writes build/bench/lora.json (`lora_fusion`: whether the LoRA graph's sites ran fused).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from llmc.bench.builds import BENCH, SMOLLM2
from llmc.bench.harness import Runs, environment, median, median_ratio, medians, passes, prompt_for, write_json

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CONTENDERS = ("base", "base_enabled", "one_adapter", "four_adapters")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", type=Path, default=SMOLLM2, help="the base model (default: SmolLM2-135M)")
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--adapters", type=int, default=4, help="adapters built in (the four_adapters traffic's)")
    p.add_argument("--held", type=int, default=32, help="adapters loaded at run time and held at once")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--mode", default="none", choices=["none", "int8-weight-only", "int4-weight-only"],
                   help="the base's quantization.mode (weight-only: a mixture's experts become QMoE)")
    p.add_argument("--loading-only", action="store_true",
                   help="only the adapters held, one loaded from disk and the TTFTs (no throughput passes)")
    p.add_argument("--out", type=Path, default=BENCH)


def make_adapters(checkpoint: Path, folder: Path, count: int, rank: int) -> list[Path]:
    """`count` PEFT adapters of `rank` on every projection (and a mixture's experts), random A and B (made once)."""
    paths = [folder / f"adapter{i}" for i in range(count)]
    if all((p / "adapter_model.safetensors").is_file() for p in paths):
        return paths
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from llmc.compiler.lora.experts import FC, expert_params

    base = AutoModelForCausalLM.from_pretrained(checkpoint)
    experts = [f"mlp.experts.{p}" for p in FC] if expert_params(base) else None  # a mixture: its experts too
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                                            target_parameters=experts, init_lora_weights=False))
    for i, path in enumerate(paths):
        torch.manual_seed(i)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.normal_(0, 0.02)
        model.save_pretrained(path)
    return paths


def build(args, adapters: list[Path]) -> Path:
    from llmc.compiler import build as run_build
    from llmc.compiler.spec import parse_spec

    streams = max(args.streams, 4)
    spec = {"name": "smollm2", "source": str(args.checkpoint), "verify": {"enabled": False},
            "export": {"attention": "paged"},
            "limits": {"max_batch_size": streams, "max_seq_len": args.prompt_tokens + args.new_tokens + 64,
                       "max_num_tokens": 512,
                       "kv_cache_tokens": streams * (args.prompt_tokens + args.new_tokens + 32)},
            "serving": {"num_threads": args.threads, "max_queue_size": 256},
            "quantization": {"mode": args.mode},
            "adapters": {f"a{i}": str(p) for i, p in enumerate(adapters)},
            "lora": {"max_slots": 4, "max_rank": max(args.rank, 16), "max_host_adapters": args.held + 2}}
    out = args.out / "lora" / f"build-{args.checkpoint.name}{'' if args.mode == 'none' else '-' + args.mode}"
    return run_build(parse_spec(spec), output=out).repository / "smollm2" / "1"


def resident() -> int:
    """This process's resident set, in bytes (Linux /proc)."""
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def engines(version: Path):
    """(the adapter-enabled engine, an engine over the same graph without the LoRA graph), tokenizer, and what each
    added to the resident set when it was opened (its sessions' packed weights, mainly; bytes)."""
    from llmc.runtime.engine.paged_engine import PagedEngine
    from llmc.runtime.manifest import RepositoryManifest
    from llmc.runtime.runners.paged import PagedRunner
    from llmc.runtime.serving.loader import load

    before = resident()
    enabled, tokenizer, _ = load(version)
    m, lim = RepositoryManifest.load(version), RepositoryManifest.load(version).limits
    between = resident()
    runner = PagedRunner(version / m.model_file, m.kv_layout, num_blocks=enabled.runner.num_blocks,
                         max_num_tokens=lim.max_num_tokens, num_threads=lim.num_threads)
    memory = {"enabled_bytes": between - before, "base_bytes": resident() - between,
              "enabled_sessions": 1 if enabled.runner.lora.shared else 2}
    plain = PagedEngine(runner, tokenizer, end_ids=tuple(m.end_ids), max_rows=lim.max_batch_size,
                        max_seq_len=lim.max_seq_len, max_num_tokens=lim.max_num_tokens,
                        max_queue_size=lim.max_queue_size, prefix_caching=lim.prefix_caching,
                        itl_ratio=lim.itl_ratio, max_beam_width=lim.max_beam_width)  # as loader.py makes it
    return enabled, plain, tokenizer, memory


def throughput(engine, prompts: list[list[int]], names: list[str | None], new_tokens: int) -> float:
    from llmc.runtime.decoding.sampling import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, temperature=0.0)
    start, tokens = time.perf_counter(), 0
    for i, (ids, name) in enumerate(zip(prompts, names)):
        engine.add_request(f"r{i}-{start}", ids, params, adapter=name)
    while engine.has_work:
        tokens += sum(len(o.token_ids) for o in engine.step())
    return tokens / (time.perf_counter() - start)


def ttft(engine, ids: list[int], name: str | None) -> float:
    from llmc.runtime.decoding.sampling import SamplingParams

    start = time.perf_counter()
    engine.add_request(f"t{start}", ids, SamplingParams(max_tokens=1, temperature=0.0), adapter=name)
    first = None
    while engine.has_work:
        outs = engine.step()
        if first is None and any(o.token_ids for o in outs):
            first = time.perf_counter() - start
    return first


def lockstep(runs: list[tuple], new_tokens: int) -> list[float]:
    """tok/s of each (engine, prompts, adapter names), every request sent at once, then one step of each engine in
    turn until all are done, over that engine's own steps' time. A pause before each step lets the previous engine's
    ONNX Runtime threads stop spinning (a base session spins after its run: ~35 ms of CPU on this host), so no step
    shares the cores with another session's spin-wait."""
    from llmc.runtime.decoding.sampling import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, temperature=0.0)
    start = time.perf_counter()
    for k, (engine, prompts, names) in enumerate(runs):
        for i, (ids, name) in enumerate(zip(prompts, names)):
            engine.add_request(f"l{k}-{i}-{start}", ids, params, adapter=name)
    spent, tokens = [0.0] * len(runs), [0] * len(runs)
    while any(engine.has_work for engine, _, _ in runs):
        for k, (engine, _, _) in enumerate(runs):
            if engine.has_work:
                time.sleep(0.1)
                begin = time.perf_counter()
                tokens[k] += sum(len(o.token_ids) for o in engine.step())
                spent[k] += time.perf_counter() - begin
    return [t / s for t, s in zip(tokens, spent)]


def lockstep_passes(args, traffic: dict, prompts) -> dict:
    """Each pass: the base engine (base traffic) in lockstep with the enabled engine under each other contender's
    traffic, the pairs in an order that turns pass by pass; ratios to the base engine's tok/s in the same pair."""
    plain = traffic["base"][0]
    pairs = {k: (lambda p, k=k: lockstep([(plain, prompts(args.streams), [None] * args.streams),
                                          (traffic[k][0], prompts(args.streams), traffic[k][1])], args.new_tokens))
             for k in CONTENDERS[1:]}
    runs = Runs("8.3f", 30)
    found = passes(pairs, args.passes, lambda p, name, v: runs.record(f"lockstep {name} / base", v[1] / v[0]))
    ratio = {k: [v[1] / v[0] for v in found[k]] for k in found}
    return {"tok_s": {k: {"base": median(v[0] for v in found[k]), k: median(v[1] for v in found[k])} for k in found},
            "ratios": {"base_enabled/base": median(ratio["base_enabled"]),
                       "four_adapters/base": median(ratio["four_adapters"]),
                       "one_adapter/base": median(ratio["one_adapter"]),
                       "four_adapters/one_adapter": median_ratio(ratio["four_adapters"], ratio["one_adapter"])},
            "per_pass": ratio}


def run(args) -> dict:
    from llmc.runtime.kernels import cpu_kernels
    from llmc.runtime.manifest import RepositoryManifest

    print(environment())
    folder = args.out / "lora" / f"adapters-{args.checkpoint.name}-r{args.rank}"
    adapters = make_adapters(args.checkpoint, folder, args.adapters + 1, args.rank)
    version = build(args, adapters[:args.adapters])
    enabled, plain, tokenizer, memory = engines(version)
    seeds = iter(range(10**6))

    def prompts(n):
        return [prompt_for(tokenizer, args.prompt_tokens, next(seeds) * 7 + 1000)[1] for _ in range(n)]

    names = [f"a{i}" for i in range(args.adapters)]
    traffic = {"base": (plain, [None] * args.streams), "base_enabled": (enabled, [None] * args.streams),
               "one_adapter": (enabled, [names[0]] * args.streams),
               "four_adapters": (enabled, [names[i % min(4, len(names))] for i in range(args.streams)])}
    throughput(enabled, prompts(2), [None, names[0]], 2)  # warm both sessions
    result = {"environment": environment(), "checkpoint": args.checkpoint.name, "mode": args.mode,
              "resident_at_open": memory}
    if not args.loading_only:
        runs = Runs("8.1f", 14)
        found = passes({k: (lambda p, k=k: throughput(traffic[k][0], prompts(args.streams), traffic[k][1],
                                                      args.new_tokens)) for k in CONTENDERS}, args.passes,
                       lambda p, name, value: runs.record(f"{name} tok/s", value))
        result["tok_s"] = medians(found)
        result["ratios"] = {"base_enabled/base": median_ratio(found["base_enabled"], found["base"]),
                            "four_adapters/base": median_ratio(found["four_adapters"], found["base"]),
                            "one_adapter/base": median_ratio(found["one_adapter"], found["base"]),
                            "four_adapters/one_adapter": median_ratio(found["four_adapters"], found["one_adapter"])}
        result["lockstep"] = lockstep_passes(args, traffic, prompts)
    else:
        throughput(enabled, prompts(4), names[:4], 4)  # every slot bound, as after the traffic
    plain.close()
    result.update(held_and_loaded(args, enabled, version, adapters[-1], tokenizer, prompts))
    enabled.close()
    result["lora_session_stackings"] = enabled.runner.lora.num_stackings if enabled.runner.lora else None
    result["lora_session_refills"] = enabled.runner.lora.num_refills if enabled.runner.lora else None
    result["manifest_sites"] = len(RepositoryManifest.load(version).lora.sites)
    result["lora_fusion"] = cpu_kernels.fuses_lora()  # LLMC_LORA_FUSION=0: the four-node branch
    print(json.dumps(result, indent=1))
    write_json(args.out / "lora.json", result)
    return result


IDLE = 0.5  # seconds the engine waits before each TTFT measured: the same idle spell before the first and the warm


def _converted(root: str, model: str, name: str, folder: str) -> tuple[bytes, float]:
    """In the converting process (the operator's, as `llmc adapters load` converts): the adapter file's bytes and the
    seconds convert took."""
    from llmc.fleet.adapters import Served, convert
    from llmc.fleet.localstore import LocalStore

    served = Served.read(LocalStore(Path(root)), model)  # as `llmc adapters load` reads it
    start = time.perf_counter()
    data = convert(served, name, Path(folder))  # an AWQ base's fold included
    return data, time.perf_counter() - start


def held_and_loaded(args, engine, version: Path, peft_folder: Path, tokenizer, prompts) -> dict:
    """--held adapters loaded at run time and held at once; one more from disk until it serves; TTFTs.

    The PEFT folder is converted in a process of its own, as `llmc adapters load` converts it outside the server: the
    torch work would otherwise run in the serving process, where a served model never runs it. Each TTFT starts after
    the same pause (IDLE): on the shared 2-core hosts measured, the first step after an idle spell ran up to 1.7x
    slower than one right after another, with an adapter or without, which would otherwise be charged to the first
    request (it follows the load) and not to the warm one (it follows the first)."""
    import multiprocessing
    import threading
    from concurrent.futures import ProcessPoolExecutor

    import numpy as np

    from llmc.runtime.lora.files import adapter_bytes
    from llmc.runtime.lora.stacks import AdapterRef, AdapterWeights
    from llmc.runtime.serving.lora_admin import LoraAdmin

    admin = LoraAdmin(engine, threading.Lock())
    template = engine.lora.store.pin(engine.lora.store.resolve("a0"))
    engine.lora.store.unpin(template.ref)
    rng = np.random.default_rng(0)
    for i in range(args.held):
        sites = {s: (rng.standard_normal(a.shape, np.float32) * 0.02, rng.standard_normal(b.shape, np.float32) * 0.02)
                 for s, (a, b) in template.sites.items()}
        admin.load(adapter_bytes(AdapterWeights(AdapterRef(f"h{i}", f"{i:064x}"), template.rank, sites)), None)
    store = engine.lora.store
    held = [r for r in store.resident if r.name.startswith("h")]
    out = {"held": len(held), "held_bytes": int(sum(store.pin(r).nbytes for r in held))}
    for r in held:
        store.unpin(r)
    loads, cold, warm = [], [], []
    where = (str(version.parents[1]), version.parent.name)
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as operator:
        operator.submit(_converted, *where, "warmup", str(peft_folder)).result()  # its imports, once
        for p in range(args.passes):
            data, converted = operator.submit(_converted, *where, f"disk{p}", str(peft_folder)).result()
            start = time.perf_counter()
            admin.load(data, None)
            loads.append((converted, converted + time.perf_counter() - start))
            time.sleep(IDLE)
            cold.append(ttft(engine, prompts(1)[0], f"disk{p}"))
            time.sleep(IDLE)
            warm.append(ttft(engine, prompts(1)[0], f"disk{p}"))
    admin.close()
    return {**out, "load_s": {"convert": median(c for c, _ in loads), "until_served": median(t for _, t in loads),
                              "until_first_token": median(t + c for (_, t), c in zip(loads, cold))},
            "ttft_s": {"first_request": median(cold), "warm_adapter": median(warm)},
            "ttft_first/warm": median_ratio(cold, warm)}
