"""What the OpenAI-compatible API (llmc/openai/) costs: time to first token and the time between
streamed chunks through the frontend against the same requests sent straight to Triton over gRPC,
in one run on one server, passes in turns (direct, frontend, direct, ...), medians over passes.

    .venv/bin/python -m llmc.bench openai BUILD_DIR [--concurrency 16] [--passes 3] [--aiperf]
        [--against PYTHONPATH] [--split-cores] [--spread]

Both sides are measured by bounded async clients written here, chunk by chunk, so they compare
like with like: llmc.client.AsyncClient for gRPC, httpx reading the SSE stream for the frontend.
The frontend side uses /v1/chat/completions when the model has a chat template (the prompt is then
the rendered template, sent as-is on the gRPC side), else /v1/completions. With --aiperf, NVIDIA's
aiperf (from its own venv, .venv-aiperf: `python3 -m venv .venv-aiperf && .venv-aiperf/bin/pip
install aiperf`) also profiles the frontend's endpoint and its summary is printed. --against
PYTHONPATH also runs a second frontend with that PYTHONPATH (e.g. `git archive OLD llmc | tar -x -C
DIR`) in the same passes: a change to the frontend measured before/after under the same load.

--split-cores gives the frontend a core of its own, as a sidecar with its own CPU request has: the
Triton server (and the model's ONNX Runtime threads, so build with serving.num_threads 1) runs on
the first core, the frontend and this benchmark's clients on the others. Without it, on a machine the
model's threads fill, the frontend's CPU per chunk comes out of the model's steps, and the
comparison measures that contention rather than the latency the frontend adds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import httpx

from llmc.bench.builds import REPO
from llmc.bench.harness import UsageError, median
from llmc.bench.load import make_prompt
from llmc.chat_template import render
from llmc.client import AsyncClient, Generation
from llmc.serve import start_server
from llmc.triton_server import free_port

AIPERF = REPO / ".venv-aiperf" / "bin" / "aiperf"


async def _direct(client: AsyncClient, model: str, prompt: str, max_tokens: int) -> tuple[float, list[float]]:
    start, times = time.perf_counter(), []
    async for _ in client.generate(prompt, True, Generation(), model=model, max_tokens=max_tokens,
                                   min_tokens=max_tokens):
        times.append(time.perf_counter() - start)
    return times[0], [b - a for a, b in zip(times, times[1:])]


async def _frontend(http: httpx.AsyncClient, url: str, body: dict) -> tuple[float, list[float]]:
    start, times = time.perf_counter(), []
    async with http.stream("POST", url, json=body) as res:
        res.raise_for_status()
        async for line in res.aiter_lines():
            if line.startswith("data: {") and _has_text(json.loads(line[6:])):
                times.append(time.perf_counter() - start)
    return times[0], [b - a for a, b in zip(times, times[1:])]


def _has_text(chunk: dict) -> bool:
    choice = chunk["choices"][0] if chunk.get("choices") else {}
    return bool(choice.get("text") or choice.get("delta", {}).get("content"))


async def _run(calls, concurrency: int) -> dict:
    todo, ttft, gaps = list(calls), [], []

    async def worker():
        while todo:
            first, between = await todo.pop()()
            ttft.append(first)
            gaps.extend(between)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return {"ttft_p50": median(ttft), "chunk_gap_p50": median(gaps),
            "seconds": time.perf_counter() - start, "chunks": len(ttft) + len(gaps)}


async def one_pass(side: str, grpc_url: str, api: str | None, model: str, chat: dict | None, args, seed: int) -> dict:
    prompts = [make_prompt(args.prompt_words, seed + i) for i in range(args.requests)]
    lengths = output_lengths(args)
    if side == "direct":
        async with AsyncClient(grpc_url, model) as client:
            texts = [render(chat, [{"role": "user", "content": p}]) if chat else p for p in prompts]
            return await _run([lambda t=t, n=n: _direct(client, model, t, n) for t, n in zip(texts, lengths)],
                              args.concurrency)
    limits = httpx.Limits(max_connections=args.concurrency)
    async with httpx.AsyncClient(timeout=300, limits=limits) as http:
        path = "/v1/chat/completions" if chat else "/v1/completions"
        bodies = [{"model": model, "stream": True, "max_tokens": n, "min_tokens": n,
                   **({"messages": [{"role": "user", "content": p}]} if chat else {"prompt": p})}
                  for p, n in zip(prompts, lengths)]
        return await _run([lambda b=b: _frontend(http, api + path, b) for b in bodies], args.concurrency)


def output_lengths(args) -> list[int]:
    """Each request's output length: all --max-tokens, or with --spread drawn from +-50% of it (the
    same draws for every side and pass), so streams end and restart at different times, as in steady
    traffic, rather than all together. In lockstep every batch of requests arrives at once and its
    TTFT is mostly the queue of its own prompts, which the order of arrival decides."""
    if not args.spread:
        return [args.max_tokens] * args.requests
    rng = random.Random(0)
    return [rng.randint(max(1, args.max_tokens // 2), args.max_tokens * 3 // 2) for _ in range(args.requests)]


def run_aiperf(api: str, model: str, chat: bool, args, out: Path) -> str:
    cmd = [str(AIPERF), "profile", "--model", model, "--url", api, "--endpoint-type", "chat" if chat else "completions",
           "--streaming", "--concurrency", str(args.concurrency), "--request-count", str(args.requests),
           "--synthetic-input-tokens-mean", str(args.prompt_words), "--output-tokens-mean", str(args.max_tokens),
           "--extra-inputs", f"min_tokens:{args.max_tokens}", "--tokenizer", str(args.tokenizer),
           "--artifact-dir", str(out), "--ui-type", "none"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        return f"aiperf failed ({res.returncode}): {res.stderr[-2000:]}"
    keep = ("Metric", "Time to First Token", "Inter Token Latency", "Request Latency", "Throughput")
    return "aiperf against the frontend:\n" + "\n".join(line for line in res.stdout.splitlines()
                                                         if any(k in line for k in keep))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("build_dir", type=Path)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--prompt-words", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--aiperf", action="store_true", help="also run aiperf against the frontend")
    parser.add_argument("--tokenizer", type=Path, default=Path("models/smollm2"), help="for aiperf")
    parser.add_argument("--against", help="PYTHONPATH of another llmc whose frontend runs in the same passes")
    parser.add_argument("--spread", action="store_true",
                        help="output lengths drawn from +-50%% of --max-tokens, so streams do not run in lockstep")
    parser.add_argument("--split-cores", action="store_true",
                        help="the server on the first core, the frontend and the clients on the rest")


def run(args: argparse.Namespace) -> None:

    cores = sorted(os.sched_getaffinity(0))
    if args.split_cores:
        if len(cores) < 2:
            raise UsageError(f"--split-cores needs at least 2 cores; this process may use {len(cores)}")
        threads = _num_threads(args.build_dir)
        if threads != 1:
            raise UsageError(f"--split-cores: the server gets one core, so build with serving.num_threads 1 "
                         f"({args.build_dir} has {threads or 'all cores'})")
        os.sched_setaffinity(0, cores[:1])  # the server's processes inherit it
    server = start_server(args.build_dir, None, None, None, None)
    if args.split_cores:
        os.sched_setaffinity(0, cores[1:])  # the frontend's process inherits it
        print(f"server on core {cores[0]}, frontend and clients on {cores[1:]}")
    try:
        with contextlib.ExitStack() as stack:
            apis = {"direct": None, "frontend": stack.enter_context(frontend_process(server.grpc_url))}
            if args.against:
                apis["against"] = stack.enter_context(frontend_process(server.grpc_url, args.against))
            model = httpx.get(f"{apis['frontend'].url}/v1/models").json()["data"][0]["id"]
            chat = asyncio.run(_template(server.grpc_url, model))
            results: dict[str, list[dict]] = {side: [] for side in apis}
            for i in range(args.passes):
                for k, side in enumerate(apis):  # turns: drift in the shared machine's load hits every side
                    seed = 1000 * (len(apis) * i + k)  # own prompts per pass: no prefix reuse
                    api = apis[side]
                    cpu = _cpu_seconds(api.pid) if api else 0.0
                    result = asyncio.run(one_pass(side, server.grpc_url, api and api.url, model, chat, args, seed))
                    if api:  # the frontend process's own CPU time per streamed chunk: less at the mercy of load
                        result["cpu_us_per_chunk"] = (_cpu_seconds(api.pid) - cpu) / result["chunks"] * 1e6
                    results[side].append(result)
            report(results, args, "chat" if chat else "completions")
            if args.aiperf:
                out = Path(tempfile.mkdtemp(prefix="aiperf-"))
                print(run_aiperf(apis["frontend"].url, model, chat is not None, args, out)
                      if AIPERF.exists() else f"aiperf: not installed at {AIPERF}")
    finally:
        server.stop()


@contextlib.contextmanager
def frontend_process(grpc_url: str, pythonpath: str | None = None):
    """`llmc openai` in a process of its own, as a sidecar runs it (in this process it would share
    the interpreter lock with the benchmark's own clients); `pythonpath` runs another llmc's."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": pythonpath} if pythonpath else None
    isolated = ["-P"] if pythonpath else []  # -P: the working directory's llmc does not shadow PYTHONPATH's
    proc = subprocess.Popen([sys.executable, *isolated, "-c", "from llmc.cli import main; main()", "openai",
                             "--url", grpc_url, "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    api = types.SimpleNamespace(url=f"http://127.0.0.1:{port}", pid=proc.pid)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{api.url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("llmc openai did not start")
            time.sleep(0.2)
        yield api
    finally:
        proc.terminate()
        proc.wait(30)


def _num_threads(build_dir: Path) -> int:
    """serving.num_threads of the build's one model (its manifest)."""
    manifests = sorted(build_dir.glob("model_repository/*/1/manifest.json"))
    if len(manifests) != 1:
        raise SystemExit(f"{build_dir}: expected one model_repository/*/1/manifest.json, found {len(manifests)}")
    return json.loads(manifests[0].read_text())["limits"]["num_threads"]


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc; psutil is not a dependency)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _template(grpc_url: str, model: str) -> dict | None:
    from llmc.openai.backends import Pool

    pool = Pool([grpc_url])
    await pool.start()
    try:
        return pool.info(model).chat_template
    finally:
        await pool.close()


def report(results: dict, args, endpoint: str) -> None:
    med = {side: {k: median(r[k] for r in runs) for k in runs[0]} for side, runs in results.items()}
    for side, runs in results.items():
        print(f"{side:9s} " + "  ".join(f"pass {i}: ttft {r['ttft_p50'] * 1e3:.1f} ms, gap {r['chunk_gap_p50'] * 1e3:.2f} ms"
                                       for i, r in enumerate(runs)))
    d = med["direct"]
    print(json.dumps({"endpoint": endpoint, "concurrency": args.concurrency, "requests": args.requests,
                      "max_tokens": args.max_tokens, "spread": args.spread,
                      "split_cores": args.split_cores, "passes": args.passes, "median_of_passes": med}, indent=1))
    for side in (s for s in med if s != "direct"):
        f = med[side]
        print(f"TTFT p50: {side} {f['ttft_p50'] * 1e3:.1f} ms / direct {d['ttft_p50'] * 1e3:.1f} ms = "
              f"{f['ttft_p50'] / d['ttft_p50']:.3f}x (target <= 1.05x)")
        print(f"chunk gap p50: {side} {f['chunk_gap_p50'] * 1e3:.2f} ms - direct {d['chunk_gap_p50'] * 1e3:.2f} ms = "
              f"{(f['chunk_gap_p50'] - d['chunk_gap_p50']) * 1e3:+.2f} ms per chunk (target <= 1 ms)")
        print(f"CPU of the {side} process: {f['cpu_us_per_chunk']:.0f} us per streamed chunk")
