"""The paged KV cache against contiguous KV slots on SmolLM2 (issue 20's targets), in one run:

    .venv/bin/python -m llmc.bench paged [--passes 3] [--sections sweep,prefix,decode,memory,budget]
                                            [--budget 256] [--budgets 128,256,512]

Both graphs are built by llmc/bench/builds.py under the same limits (16 rows a step, 2048
tokens a request, the paged pool 16 x 2048 tokens = the slot graph's memory; fp32, 2 ONNX Runtime
threads; the slot graph prefills in chunks of up to 8192 tokens, the paged graph mixes decode rows
and prompt chunks within --budget tokens a step and the default serving.itl_ratio) and served by
Triton on free ports as `llmc bench BUILD` serves them. Each pass measures a section on both graphs,
the order alternating pass by pass; figures are medians over passes, ratios medians of per-pass
ratios (paged / slot). Every request has
its own prompt (llmc/bench/load.py), so nothing is served from a prefix cache unless it is meant to be.

sweep    4 and 16 streams, ~300-token prompts, 64 new tokens (2 x streams requests): inter-token
         latency p50/p99, TTFT p50/p99, generated tokens/s; then decode-heavy: 16 streams,
         64-token prompts, 256 new tokens (16 requests): generated tokens/s
prefix   16 requests sharing a 1,000-token system prompt (a new one each pass): the first alone,
         then the other 15 at once; their TTFT p50 with serving.prefix_caching on and off
decode   in process, no prefill in flight (llmc/bench/serving/paged_decode.py)
memory   one pass: the paged graph with max_seq_len 8192 and 64 rows a step, on a pool of 16 x 2048
         tokens, serves 64 streams of ~300-token prompts at once, then one 8,000-token request
budget   the paged graph under each of --budgets tokens a step, and under --budget without the step
         cost cap (serving.itl_ratio: null, runtime/engine/step_cost.py), 16 streams as in sweep

The host is shared: before each measurement the benchmark samples how busy its CPUs are with the
servers idle (1 s of /proc/stat) and marks the measurements that started over 25% busy.
Writes build/bench/paged.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import sys
import threading
import time
from pathlib import Path

from llmc.bench.builds import BENCH, LIMITS, POOL, build_variant
from llmc.bench.harness import UsageError, in_turn, median, median_ratio, write_json

SECTIONS = ("sweep", "prefix", "decode", "memory", "budget")
_seeds = itertools.count(0, 1000)  # each load its own prompts: no server sees a prompt twice


def cpu_busy(seconds: float = 1.0) -> float:
    """The fraction of the host's CPU time spent busy over `seconds` (our servers idle meanwhile)."""
    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(fields), fields[3] + fields[4]

    (t0, i0), _, (t1, i1) = sample(), time.sleep(seconds), sample()
    return 1 - (i1 - i0) / max(t1 - t0, 1)


class Record:
    """Every figure by name, one value per pass, and the host's load before each measurement."""

    def __init__(self):
        self.runs: dict[str, list[float]] = {}
        self.noise: list[tuple[str, float]] = []

    def busy(self, label: str) -> None:
        value = cpu_busy()
        self.noise.append((label, value))
        print(f"  [{label}] host busy {value:.0%} before it{'  DISTURBED' if value > 0.25 else ''}", file=sys.stderr)

    def add(self, name: str, value: float | None) -> None:
        self.runs.setdefault(name, []).append(float("nan") if value is None else value)
        print(f"    {name:<40} {value if value is not None else float('nan'):10.3f}", file=sys.stderr)

    def median(self, name: str) -> float:
        return median(self.runs[name])

    def ratio(self, a: str, b: str) -> float:
        return median_ratio(self.runs[a], self.runs[b])


def load(server, *, streams: int, requests: int, words: int, tokens: int, **kwargs) -> dict:
    from llmc.bench.load import run_load

    result = asyncio.run(run_load(server.grpc_url, None, concurrency=streams, num_requests=requests, prompt_words=words,
                                  max_tokens=tokens, first_seed=next(_seeds), **kwargs))
    return result.summary()


def record_load(rec: Record, label: str, s: dict) -> None:
    ms = {k: s[k] * 1000 for k in ("itl_s_p50", "itl_s_p99", "ttft_s_p50", "ttft_s_p99")}
    rec.add(f"{label} ITL p50 ms", ms["itl_s_p50"])
    rec.add(f"{label} ITL p99 ms", ms["itl_s_p99"])
    rec.add(f"{label} ITL p99/p50", ms["itl_s_p99"] / ms["itl_s_p50"])
    rec.add(f"{label} TTFT p50 ms", ms["ttft_s_p50"])
    rec.add(f"{label} TTFT p99 ms", ms["ttft_s_p99"])
    rec.add(f"{label} tok/s", s["tokens_per_s"])
    rec.add(f"{label} errors", s["errors"])


@contextlib.contextmanager
def serving(variants: dict[str, Path]):
    """Triton on each variant's repository (free ports), all stopped at the end."""
    from llmc.serve import start_server

    servers = {}
    try:
        for name, folder in variants.items():
            servers[name] = start_server(folder, None, None, None, None)
        yield servers
    finally:
        for server in servers.values():
            server.stop()


def sweep_pass(servers: dict, p: int, rec: Record) -> None:
    for streams in (4, 16):
        for g in in_turn(["slot", "paged"], p):
            rec.busy(f"pass {p + 1} sweep {streams} streams {g}")
            record_load(rec, f"{g} {streams} streams", load(servers[g], streams=streams, requests=2 * streams,
                                                             words=300, tokens=64))
    for g in in_turn(["slot", "paged"], p):
        rec.busy(f"pass {p + 1} decode-heavy {g}")
        s = load(servers[g], streams=16, requests=16, words=64, tokens=256)
        rec.add(f"{g} decode-heavy tok/s", s["tokens_per_s"])
        rec.add(f"{g} decode-heavy errors", s["errors"])


def prefix_pass(servers: dict, p: int, rec: Record) -> None:
    for g in in_turn(["prefix on", "prefix off"], p):
        rec.busy(f"pass {p + 1} prefix {g}")
        system = next(_seeds)  # this pass's system prompt, new to the server
        first = load(servers[g], streams=1, requests=1, words=32, tokens=8, shared_prefix=1000, prefix_seed=system)
        rest = load(servers[g], streams=15, requests=15, words=32, tokens=8, shared_prefix=1000, prefix_seed=system)
        rec.add(f"{g} first request TTFT ms", first["ttft_s_p50"] * 1000)
        rec.add(f"{g} later TTFT p50 ms", rest["ttft_s_p50"] * 1000)
        rec.add(f"{g} prompt tokens", rest["prompt_tokens_mean"])
        rec.add(f"{g} errors", first["errors"] + rest["errors"])


def budget_pass(servers: dict, p: int, rec: Record) -> None:
    for name in in_turn(list(servers), p):
        rec.busy(f"pass {p + 1} {name}")
        record_load(rec, f"{name} 16 streams", load(servers[name], streams=16, requests=32, words=300, tokens=64))


def memory(server, rec: Record, repository: Path) -> None:
    """64 streams at once from a pool of 16 x 2048 tokens, then one 8,000-token request, on max_seq_len 8192."""
    from llmc.runtime.manifest import RepositoryManifest
    from llmc.soak import llmc_metrics

    url = f"http://127.0.0.1:{server.ports.metrics}"
    peak = {"llmc_requests_running": 0.0}
    done = threading.Event()

    def poll() -> None:
        while not done.wait(0.25):
            with contextlib.suppress(OSError):
                values = llmc_metrics(url, "smollm2")
                for k in peak:
                    peak[k] = max(peak[k], values.get(k, 0.0))

    m = RepositoryManifest.load(next((repository / "model_repository" / "smollm2").glob("[0-9]*")))
    lay = m.kv_layout
    per_token = 2 * lay.num_layers * lay.num_kv_heads * lay.head_dim * 4  # fp32 keys and values
    rec.add("memory pool tokens", m.limits.kv_cache_tokens)
    rec.add("memory pool GiB", m.limits.kv_cache_tokens * per_token / 2**30)
    rec.add("memory slots for 64 x 8192 GiB", 64 * 8192 * per_token / 2**30)
    rec.busy("memory 64 streams")
    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    s = load(server, streams=64, requests=64, words=300, tokens=32)
    done.set()
    poller.join()
    rec.add("memory 64 streams errors", s["errors"])
    rec.add("memory 64 streams prompt tokens", s["prompt_tokens_mean"])
    rec.add("memory 64 streams peak running", peak["llmc_requests_running"])
    rec.add("memory 64 streams tok/s", s["tokens_per_s"])
    rec.add("memory 64 streams TTFT p99 ms", s["ttft_s_p99"] * 1000)
    rec.busy("memory 8000-token request")
    long = load(server, streams=1, requests=1, words=7990, tokens=8)
    rec.add("memory long request errors", long["errors"])
    rec.add("memory long request prompt tokens", long["prompt_tokens_mean"])
    rec.add("memory long request TTFT ms", long["ttft_s_p50"] * 1000)
    rec.add("memory preemptions", llmc_metrics(url, "smollm2").get("llmc_preemptions_total", 0.0))


def targets(rec: Record) -> list[tuple[str, float, str, bool]]:
    """(what, value, target, met) for each of issue 20's targets whose figures this run has."""
    rows, have = [], rec.runs.keys()
    for streams in (4, 16):
        if f"paged {streams} streams ITL p99/p50" in have:
            v = rec.median(f"paged {streams} streams ITL p99/p50")
            rows.append((f"{streams} streams: paged ITL p99 / its p50", v, "<= 3", v <= 3))
            slot = rec.median(f"slot {streams} streams ITL p99/p50")
            rows.append((f"{streams} streams: slot ITL p99 / its p50 (today)", slot, "-", True))
            for what, key, better_low in (("TTFT p99", "TTFT p99 ms", True), ("tokens/s", "tok/s", False)):
                r = rec.ratio(f"paged {streams} streams {key}", f"slot {streams} streams {key}")
                rows.append((f"{streams} streams: {what} paged / slot", r, "<= 1.0" if better_low else ">= 1.0",
                             r <= 1.0 if better_low else r >= 1.0))
    if "paged decode-heavy tok/s" in have:
        r = rec.ratio("paged decode-heavy tok/s", "slot decode-heavy tok/s")
        rows.append(("decode-heavy tokens/s paged / slot", r, ">= 1.15", r >= 1.15))
    for precision in ("fp32", "int4"):
        for batch, floor in ((1, 0.95), (16, 1.0)):
            key = f"{precision} batch {batch}"
            if f"paged {key} decode tok/s" in have:
                r = rec.ratio(f"paged {key} decode tok/s", f"slot {key} decode tok/s")
                rows.append((f"decode only, {key}: paged / slot", r, f">= {floor}", r >= floor))
    if "prefix on later TTFT p50 ms" in have:
        r = rec.ratio("prefix off later TTFT p50 ms", "prefix on later TTFT p50 ms")
        rows.append(("prefix: later TTFT p50, caching off / on", r, ">= 5", r >= 5))
    if "memory pool tokens" in have:
        ok = (rec.median("memory pool tokens") <= POOL and rec.median("memory 64 streams errors") == 0
              and rec.median("memory 64 streams peak running") == 64 and rec.median("memory long request errors") == 0)
        rows.append(("memory: 64 streams at once + an 8,000-token request, pool <= 16 x 2048",
                     rec.median("memory 64 streams peak running"), "64 running, 0 errors", ok))
    return rows


def report(rec: Record, args) -> None:
    print(f"\nSmolLM2, {args.passes} pass(es), paged budget {args.budget} tokens a step; limits {LIMITS}; medians "
          "(per-pass values in brackets)")
    for name, values in rec.runs.items():
        print(f"  {name:<44} {median(values):10.2f}   [{', '.join(f'{v:.2f}' for v in values)}]")
    disturbed = [label for label, busy in rec.noise if busy > 0.25]
    print(f"\nhost busy before measurements: median {median(b for _, b in rec.noise):.0%}, "
          f"max {max(b for _, b in rec.noise):.0%}; disturbed (>25%): {', '.join(disturbed) or 'none'}")
    print("\ntargets")
    for what, value, target, met in targets(rec):
        print(f"  {what:<66} {value:7.2f}  {target:<22} {'ok' if met else 'MISSED'}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--passes", type=int, default=3, help="passes over each section (default 3)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"which of {','.join(SECTIONS)}")
    parser.add_argument("--budget", type=int, default=None, help="the paged graph's tokens a step (default: llmc's)")
    parser.add_argument("--budgets", default="128,256,512", help="token budgets the budget section compares")
    parser.add_argument("--json", type=Path, default=BENCH / "paged.json")


def run(args: argparse.Namespace) -> None:
    from llmc.compiler.spec.sections import PAGED_MAX_NUM_TOKENS

    args.budget = args.budget or PAGED_MAX_NUM_TOKENS
    sections = [s for s in args.sections.split(",") if s]
    if unknown := set(sections) - set(SECTIONS):
        raise UsageError(f"--sections: unknown {sorted(unknown)}; choose from {','.join(SECTIONS)}")
    budget = {"max_num_tokens": args.budget}
    rec = Record()
    paged = {"paged": build_variant(f"paged-{args.budget}", "paged", limits=budget)}
    if "sweep" in sections:
        with serving({"slot": build_variant("slot", "fused"), **paged}) as servers:
            for p in range(args.passes):
                sweep_pass(servers, p, rec)
    if "prefix" in sections:
        off = build_variant(f"paged-{args.budget}-no-prefix-caching", "paged", limits=budget,
                            serving={"prefix_caching": False})
        with serving({"prefix on": paged["paged"], "prefix off": off}) as servers:
            for p in range(args.passes):
                prefix_pass(servers, p, rec)
    if "decode" in sections:
        from llmc.bench.serving import paged_decode

        paged_decode.measure(rec, args.passes)
    if "memory" in sections:
        # prompts admitted 2048 tokens a step, uncapped, so all 64 streams hold their KV before any ends
        folder = build_variant("paged-memory", "paged", limits={"max_num_tokens": 2048, "max_batch_size": 64,
                                                               "max_seq_len": 8192, "kv_cache_tokens": POOL},
                               serving={"itl_ratio": None})
        with serving({"memory": folder}) as servers:
            memory(servers["memory"], rec, folder)
    if "budget" in sections:
        variants = {f"budget {b}": build_variant(f"paged-{b}", "paged", limits={"max_num_tokens": b})
                    for b in (int(v) for v in args.budgets.split(","))}
        variants[f"budget {args.budget} uncapped"] = build_variant(f"paged-{args.budget}-uncapped", "paged",
                                                                   limits=budget, serving={"itl_ratio": None})
        with serving(variants) as servers:
            for p in range(args.passes):
                budget_pass(servers, p, rec)
    report(rec, args)
    write_json(args.json, {"passes": args.passes, "budget": args.budget, "limits": LIMITS, "runs": rec.runs,
                           "host_busy": rec.noise})
