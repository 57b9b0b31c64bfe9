"""What `llmc serve` and `llmc generate` do, as functions (the CLI only parses arguments).

Runtime errors (TritonError, GenerationError) become `ServingError`, so the CLI prints one line.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TextIO

from llmc.errors import ServingError


def start_server(build_dir: Path | str, http_port: int | None, grpc_port: int | None, metrics_port: int | None,
                 serving_env: Path | None):
    """Start Triton on a build's repository, or on an s3:// repository (ports None: free ones); errors
    name what to change."""
    from llmc.supervisor import EXPLICIT_ARGS
    from llmc.triton_server import (Ports, TritonError, TritonServer, assemble, check_port_free,
                                    default_server_dir, find_serving_env)

    try:
        repository = _repository(build_dir)
        env = find_serving_env(serving_env)
        ports = Ports.free(http_port, grpc_port, metrics_port)
        flags = ("--http-port", "--grpc-port", "--metrics-port")
        for port, flag in zip((ports.http, ports.grpc, ports.metrics), flags):
            check_port_free(port, flag)
        server_dir = assemble(default_server_dir())
        label = repository.rstrip("/").rsplit("/", 1)[-1] if isinstance(repository, str) else repository.parent.name
        log = server_dir.parent / "logs" / f"serve-{label}-{time.strftime('%Y%m%d-%H%M%S')}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        server = TritonServer(repository, server_dir=server_dir, serving_env=env,
                              ports=ports, log_path=log, extra_args=EXPLICIT_ARGS)
        return server.start(timeout=300)
    except TritonError as err:
        raise ServingError(str(err)) from None


def _repository(location: Path | str) -> Path | str:
    """A build folder's repository (resolved), or an s3:// repository checked to hold a model."""
    from llmc.fleet.objectstore import open_store
    from llmc.fleet.store import StoreError, is_remote
    from llmc.triton_server import find_repository

    if not is_remote(location):
        return find_repository(Path(location)).resolve()
    try:
        store = open_store(location)
        store.check()
        if not store.models():
            raise ServingError(f"{location}: no model there yet; publish one with "
                               f"llmc deploy BUILD --repository {location}")
    except StoreError as err:
        raise ServingError(str(err)) from None
    return str(location)


def serve_forever(build_dir: Path, http_port: int, grpc_port: int, metrics_port: int, serving_env: Path | None, *,
                  openai_port: int = 0, api_key: str | None = None, allow_lora_updates: bool = False) -> None:
    """Triton (and, with `openai_port`, the OpenAI-compatible API in front of it) until Ctrl-C."""
    from llmc.console import console
    from llmc.openai.server import start_beside
    from llmc.fleet.objectstore import open_store
    from llmc.supervisor import Supervisor

    server = start_server(build_dir, http_port, grpc_port, metrics_port, serving_env)
    frontend = None
    try:
        frontend = start_beside(server.grpc_url, openai_port, api_key, allow_lora_updates=allow_lora_updates,
                                repository=str(server.repository))
        supervisor = Supervisor(server, log=lambda message: console.print(f"[yellow]{time.strftime('%H:%M:%S')}[/] {message}"))
        models = open_store(server.repository).models()
        console.print(f"[green]serving[/] {', '.join(models)} from {server.repository}")
        console.print(f"  gRPC     {server.grpc_url}   llmc generate --url {server.grpc_url} \"Hello\"")
        console.print(f"  HTTP     http://{server.http_url}/v2/models/{models[0]}/generate (and generate_stream)")
        console.print(f"  metrics  http://127.0.0.1:{server.ports.metrics}/metrics")
        if frontend is not None:
            console.print(f"  OpenAI   {frontend.url}/v1  (chat/completions, completions, models)")
        console.print(f"  log      {server.log_path}")
        console.print(f"  deploy   llmc deploy BUILD --repository {server.repository} --url {server.grpc_url}")
        console.print("Ctrl-C to stop")
        while True:
            time.sleep(0.5)
            try:
                supervisor.check()  # a crashed model instance is reloaded, a crashed server restarted
            except RuntimeError as err:
                raise ServingError(str(err)) from None
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the normal way to stop
        console.print("stopping Triton (requests in flight get up to 10 s)...")
    finally:
        if frontend is not None:
            frontend.stop()
        server.stop()
    console.print("stopped")


def generate_to(out: TextIO, prompt: str, *, url: str, model: str | None, stream: bool, chat: bool = False,
                **params) -> None:
    """Stream a generation to `out`; `chat`: the prompt is a user message, rendered with the served
    model's chat template (llmc/chat_template.py)."""
    from llmc.client import Client, Generation, GenerationError
    from llmc.console import console

    client = Client(url, model)
    gen = Generation()
    try:
        if chat:
            from llmc.chat_template import chat_prompt

            prompt = chat_prompt(url, client.model, prompt)
            params["add_special_tokens"] = False  # the template wrote its own BOS (llmc.chat_template)
        for chunk in client.generate(prompt, stream, gen, **{k: v for k, v in params.items() if v is not None}):
            if gen.beams is None:
                out.write(chunk)
                out.flush()
    except GenerationError as err:
        raise ServingError(str(err)) from None
    if gen.beams is not None:  # beam search: every beam, best first, with its summed log-probability
        for i, (text, ids, logp) in enumerate(zip(gen.beams, gen.beam_ids, gen.cum_log_probs)):
            out.write(f"[beam {i}: {len(ids)} tokens, cum_log_prob {logp:.4f}]\n{text}\n")
        console.print(f"[dim]finish_reason: {gen.finish_reason}, {len(gen.beams)} beams[/]")
        return
    out.write("\n")
    console.print(f"[dim]finish_reason: {gen.finish_reason}, {len(gen.output_ids)} tokens[/]")


def bench(build_dir: Path | None, *, url: str | None, model: str | None, concurrency: int, num_requests: int,
          prompt_words: int, max_tokens: int, serving_env: Path | None = None, sweep: list[int] | None = None,
          shared_prefix: int = 0) -> dict:
    """Against `url` or a server started here on `build_dir` (free ports, stopped afterwards): a
    sequential baseline, then `num_requests` streams at `concurrency`; or, with `sweep`, one run per
    concurrency level (2 x level requests, at least 4). Every request of every run has its own prompt;
    with `shared_prefix`, each run's prompts start with that run's own system prompt of about that
    many tokens. Returns each run's summary by name and `throughput_ratio` (the last run's tokens/s
    over the first's)."""
    import asyncio

    from llmc.bench.load import run_load
    from llmc.console import progress_bar

    if sweep:
        levels = [(f"{c} concurrent" if c > 1 else "sequential", c, max(4, 2 * c)) for c in sweep]
    else:
        levels = [("sequential", 1, max(3, num_requests // concurrency)), (f"{concurrency} concurrent", concurrency,
                                                                          num_requests)]
    server = start_server(build_dir, None, None, None, serving_env) if url is None else None
    target = url or server.grpc_url
    try:
        results, first_seed = {}, 0
        for name, c, n in levels:
            with progress_bar(f"{name}: {n} requests, {max_tokens} tokens each") as advance:
                load = asyncio.run(run_load(target, model, concurrency=c, num_requests=n, prompt_words=prompt_words,
                                            max_tokens=max_tokens, progress=advance, first_seed=first_seed,
                                            shared_prefix=shared_prefix))
            first_seed += n
            results[name] = load.summary()
            if results[name]["errors"]:
                first = next(r.error for r in load.requests if r.error)
                results[name]["first_error"] = first
    except Exception as err:
        from llmc.client import GenerationError

        if isinstance(err, GenerationError):
            raise ServingError(str(err)) from None
        raise
    finally:
        if server is not None:
            server.stop()
    runs = list(results.values())
    results["throughput_ratio"] = runs[-1]["tokens_per_s"] / runs[0]["tokens_per_s"]
    return results


def plot_sweep(results: dict, path: Path) -> Path:
    """A PNG of throughput and latency percentiles against concurrency (matplotlib, the bench extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = sorted((r for r in results.values() if isinstance(r, dict)), key=lambda r: r["concurrency"])
    level = [r["concurrency"] for r in runs]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.plot(level, [r["tokens_per_s"] for r in runs], marker="o")
    left.set(xlabel="concurrent streams", ylabel="generated tokens/s", title="throughput")
    for metric, label in (("ttft_s", "time to first token"), ("itl_s", "inter-token"), ("latency_s", "request")):
        for pct, style in (("p50", "-"), ("p99", "--")):
            values = [r[f"{metric}_{pct}"] * 1000 if r[f"{metric}_{pct}"] is not None else float("nan") for r in runs]
            right.plot(level, values, style, marker="o", label=f"{label} {pct}")
    right.set(xlabel="concurrent streams", ylabel="ms", title="latency", yscale="log")
    right.legend(fontsize=7)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(level, [str(c) for c in level])
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
