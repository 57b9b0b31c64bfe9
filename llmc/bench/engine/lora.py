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

An engine's speed also depends on where its allocations land: two identical plain engines opened one after the other
ran 5.6% and 4.8% apart on an AMX host, the second-opened faster. So the bench opens --copies pairs of engines, in
turns that balance the order (enabled then base, base then enabled, ...: positions 1+4 against 2+3 for two pairs),
runs every contender on every pair each pass, and takes each ratio within a pair; the medians pool the pairs
(`by_pair`: each pair's own, which shows what the order was worth).

Then, once (lora_loading.py): --held adapters loaded at run time through the serving loop's control requests
(runtime/serving/lora_admin.py) and held in host memory at once (their bytes); one more adapter from its PEFT folder
on disk until it serves (converted in a process of its own, as `llmc adapters load` does, then loaded; target < 1 s
at 0.5B rank 16), and the first request's TTFT on it against a warm adapter's (target <= 1.2x), medians over
--passes.

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
from llmc.bench.engine.lora_loading import held_and_loaded
from llmc.bench.harness import Runs, UsageError, environment, median, passes, prompt_for, write_json

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
    p.add_argument("--copies", type=int, default=2,
                   help="pairs of engines (adapter-enabled and base) opened in balanced order; ratios pool them")
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


def engines(version: Path, copies: int):
    """`copies` pairs of (the adapter-enabled engine, an engine over the same graph without the LoRA graph), opened in
    turns that balance the order (pair k opens the enabled engine first when k is even), the tokenizer, and what each
    of the first pair added to the resident set when it was opened (its sessions' packed weights, mainly; bytes)."""
    from llmc.runtime.decoding.tokenizer import load as load_tokenizer
    from llmc.runtime.manifest import RepositoryManifest
    from llmc.runtime.serving.loader import load

    tokenizer = load_tokenizer(version / RepositoryManifest.load(version).tokenizer)
    pairs, memory = [], {}
    for k in range(copies):
        opened = {}
        for kind in ("enabled", "base") if k % 2 == 0 else ("base", "enabled"):
            before = resident()
            opened[kind] = load(version)[0] if kind == "enabled" else plain_engine(version, tokenizer)
            memory.setdefault(f"{kind}_bytes", resident() - before)
        pairs.append((opened["enabled"], opened["base"]))
    memory["enabled_sessions"] = 1 if pairs[0][0].runner.lora.shared else 2
    return pairs, tokenizer, memory


def plain_engine(version: Path, tokenizer):
    """The engine loader.py makes of `version` with its manifest's `lora` dropped: what a build without adapters
    serves (the same graph, pools and limits, no LoRA graph)."""
    from llmc.runtime.manifest import RepositoryManifest
    from llmc.runtime.serving.loader import paged_engine

    m = RepositoryManifest.load(version)
    return paged_engine(version, m.model_copy(update={"lora": None}), tokenizer)


def throughput(engine, prompts: list[list[int]], names: list[str | None], new_tokens: int) -> float:
    from llmc.runtime.decoding.sampling import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, temperature=0.0)
    start, tokens = time.perf_counter(), 0
    for i, (ids, name) in enumerate(zip(prompts, names)):
        engine.add_request(f"r{i}-{start}", ids, params, adapter=name)
    while engine.has_work:
        tokens += sum(len(o.token_ids) for o in engine.step())
    return tokens / (time.perf_counter() - start)


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


RATIOS = (("base_enabled", "base"), ("four_adapters", "base"), ("one_adapter", "base"),
          ("four_adapters", "one_adapter"))


def ratios(found: dict[str, list[float]], copies: int) -> tuple[dict, dict]:
    """Each of RATIOS from `found` (keyed `<contender> <pair>`, a value a pass): the median over every pass and pair
    of the numerator over the denominator in the same pass and pair, and each pair's own median."""
    pooled, by_pair = {}, {}
    for num, den in RATIOS:
        per = [[a / b for a, b in zip(found[f"{num} {k}"], found[f"{den} {k}"])] for k in range(copies)]
        pooled[f"{num}/{den}"] = median(r for pair in per for r in pair)
        by_pair[f"{num}/{den}"] = [median(pair) for pair in per]
    return pooled, by_pair


def lockstep_passes(args, traffic: list[dict], prompts) -> dict:
    """Each pass, on every pair: the base engine (base traffic) in lockstep with the enabled engine under each other
    contender's traffic, in an order that turns pass by pass; each ratio to the base engine's tok/s in the same run."""
    def paired(kind: str, k: int):
        plain, enabled = traffic[k]["base"][0], traffic[k][kind]
        return lambda p: lockstep([(plain, prompts(args.streams), [None] * args.streams),
                                   (enabled[0], prompts(args.streams), enabled[1])], args.new_tokens)

    runs = Runs("8.3f", 32)
    found = passes({f"{kind} {k}": paired(kind, k) for k in range(len(traffic)) for kind in CONTENDERS[1:]},
                   args.passes, lambda p, name, v: runs.record(f"lockstep {name} / base", v[1] / v[0]))
    relative = {name: [v[1] / v[0] for v in values] for name, values in found.items()}  # each to its own base run
    relative.update({f"base {k}": [1.0] * args.passes for k in range(len(traffic))})
    pooled, by_pair = ratios(relative, len(traffic))
    return {"tok_s": {kind: {"base": median(v[0] for k in range(len(traffic)) for v in found[f"{kind} {k}"]),
                             kind: median(v[1] for k in range(len(traffic)) for v in found[f"{kind} {k}"])}
                      for kind in CONTENDERS[1:]},
            "ratios": pooled, "by_pair": by_pair,
            "per_pass": {kind: [r for k in range(len(traffic)) for r in relative[f"{kind} {k}"]]
                         for kind in CONTENDERS[1:]}}


def run(args) -> dict:
    from llmc.runtime.kernels import cpu_kernels
    from llmc.runtime.manifest import RepositoryManifest

    if args.copies < 1:
        raise UsageError(f"--copies must be at least 1 (got {args.copies})")
    print(environment())
    folder = args.out / "lora" / f"adapters-{args.checkpoint.name}-r{args.rank}"
    adapters = make_adapters(args.checkpoint, folder, args.adapters + 1, args.rank)
    version = build(args, adapters[:args.adapters])
    pairs, tokenizer, memory = engines(version, args.copies)
    seeds = iter(range(10**6))

    def prompts(n):
        return [prompt_for(tokenizer, args.prompt_tokens, next(seeds) * 7 + 1000)[1] for _ in range(n)]

    names = [f"a{i}" for i in range(args.adapters)]
    traffic = [{"base": (plain, [None] * args.streams), "base_enabled": (enabled, [None] * args.streams),
                "one_adapter": (enabled, [names[0]] * args.streams),
                "four_adapters": (enabled, [names[i % min(4, len(names))] for i in range(args.streams)])}
               for enabled, plain in pairs]
    for enabled, _ in pairs:
        throughput(enabled, prompts(2), [None, names[0]], 2)  # warm both sessions
    result = {"environment": environment(), "checkpoint": args.checkpoint.name, "mode": args.mode,
              "copies": args.copies, "resident_at_open": memory}
    if not args.loading_only:
        runs = Runs("8.1f", 16)
        contenders = {f"{kind} {k}": (lambda p, run=mix[kind]: throughput(run[0], prompts(args.streams), run[1],
                                                                            args.new_tokens))
                      for k, mix in enumerate(traffic) for kind in CONTENDERS}
        found = passes(contenders, args.passes, lambda p, name, value: runs.record(f"{name} tok/s", value))
        result["tok_s"] = {kind: median(v for k in range(args.copies) for v in found[f"{kind} {k}"])
                           for kind in CONTENDERS}
        result["ratios"], result["by_pair"] = ratios(found, args.copies)
        result["lockstep"] = lockstep_passes(args, traffic, prompts)
    enabled = pairs[0][0]
    for other, plain in pairs:
        plain.close()
        if other is not enabled:
            other.close()
    if args.loading_only:
        throughput(enabled, prompts(4), names[:4], 4)  # every slot bound, as after the traffic
    result.update(held_and_loaded(args, enabled, version, adapters[-1], tokenizer, prompts))
    enabled.close()
    result["lora_session_stackings"] = enabled.runner.lora.num_stackings if enabled.runner.lora else None
    result["lora_session_refills"] = enabled.runner.lora.num_refills if enabled.runner.lora else None
    result["manifest_sites"] = len(RepositoryManifest.load(version).lora.sites)
    result["lora_fusion"] = cpu_kernels.fuses_lora()  # LLMC_LORA_FUSION=0: the four-node branch
    print(json.dumps(result, indent=1))
    write_json(args.out / "lora.json", result)
    return result
