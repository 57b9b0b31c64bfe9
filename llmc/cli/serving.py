"""Commands that serve or call a model: serve, openai, generate, bench."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from llmc.cli.app import app, friendly


@app.command()
@friendly
def serve(
    build_dir: Annotated[Optional[Path], typer.Argument(help="A build folder (or its model_repository/).", show_default=False)] = None,
    repository: Annotated[Optional[str], typer.Option(help="Serve this repository instead of a build: s3://\\[http://host:port/]bucket/prefix (AWS credentials from the environment), as `llmc deploy` publishes it.", show_default=False)] = None,
    http_port: Annotated[int, typer.Option(help="HTTP port (generate / generate_stream endpoints).")] = 8000,
    grpc_port: Annotated[int, typer.Option(help="gRPC port (tritonclient, llmc generate).")] = 8001,
    metrics_port: Annotated[int, typer.Option(help="Prometheus metrics port.")] = 8002,
    serving_env: Annotated[Optional[Path], typer.Option(help="The venv model.py runs in (default: $LLMC_SERVING_ENV or the .venv-serving made by scripts/setup.sh).")] = None,
    openai_port: Annotated[int, typer.Option(help="Port of the OpenAI-compatible API on 127.0.0.1 (0: none).")] = 9000,
    api_key: Annotated[Optional[str], typer.Option(envvar="LLMC_API_KEY", help="Require `Authorization: Bearer KEY` on the OpenAI API's /v1 routes.", show_default=False)] = None,
    allow_lora_updates: Annotated[bool, typer.Option("--allow-lora-updates", envvar="LLMC_ALLOW_RUNTIME_LORA_UPDATING", help="The OpenAI API's /v1/load_lora_adapter and /v1/unload_lora_adapter (LoRA adapters loaded into the repository's store and the server while it serves; docs/lora.md).")] = False,
) -> None:
    """Serve a build on a local Triton Inference Server (127.0.0.1) until Ctrl-C or SIGTERM, with the OpenAI-compatible API in front of it (--openai-port).

    The server comes from the nvidia-pytriton wheel (assembled once under ~/.cache/llmc). Call it with `llmc generate`, tritonclient, or HTTP: curl -d '{"text_input": "Hi", "max_tokens": 16}' 127.0.0.1:8000/v2/models/NAME/generate
    """
    from llmc.errors import UnsupportedError
    from llmc.serve import serve_forever

    if (build_dir is None) == (repository is None):
        raise UnsupportedError("pass a BUILD_DIR, or --repository s3://... (not both)")
    serve_forever(build_dir or repository, http_port, grpc_port, metrics_port, serving_env, openai_port=openai_port,
                  api_key=api_key, allow_lora_updates=allow_lora_updates)


@app.command(name="openai")
@friendly
def openai_api(
    url: Annotated[list[str], typer.Option("--url", help="A running Triton server's gRPC address (repeatable: requests go to the one with the fewest in flight).", show_default=False)],
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to bind.")] = 9000,
    api_key: Annotated[Optional[str], typer.Option(envvar="LLMC_API_KEY", help="Require `Authorization: Bearer KEY` on every /v1 route.", show_default=False)] = None,
    allow_lora_updates: Annotated[bool, typer.Option("--allow-lora-updates", envvar="LLMC_ALLOW_RUNTIME_LORA_UPDATING", help="/v1/load_lora_adapter and /v1/unload_lora_adapter (needs --repository).")] = False,
    repository: Annotated[Optional[str], typer.Option(help="The servers' model repository (a folder or s3://...), where loaded LoRA adapters are kept.", show_default=False)] = None,
) -> None:
    """Run the OpenAI-compatible API alone, in front of one or more running Triton servers (a sidecar or gateway), until Ctrl-C.

    /v1/models, /v1/completions, /v1/chat/completions (the build's chat template), /health. Servers that fail their health check are skipped until they recover.
    """
    from llmc.console import console
    from llmc.openai.server import run

    console.print(f"[green]OpenAI API[/] on http://{host}:{port}/v1 in front of {', '.join(url)}; Ctrl-C to stop")
    run(url, host=host, port=port, api_key=api_key, allow_lora_updates=allow_lora_updates, repository=repository)


@app.command()
@friendly
def generate(
    prompt: Annotated[str, typer.Argument(help="The prompt text.", show_default=False)],
    url: Annotated[str, typer.Option(help="The server's gRPC address.")] = "127.0.0.1:8001",
    model: Annotated[Optional[str], typer.Option(help="Model name (default: the server's only ready model).")] = None,
    max_tokens: Annotated[Optional[int], typer.Option(help="Tokens to generate at most (default: the build's serving.default_max_tokens).")] = None,
    temperature: Annotated[Optional[float], typer.Option(help="0 = greedy (the default); higher samples more freely.")] = None,
    top_p: Annotated[Optional[float], typer.Option(help="Nucleus sampling: keep the most likely tokens up to this probability mass.")] = None,
    top_k: Annotated[Optional[int], typer.Option(help="Sample among the k most likely tokens (0 = no limit).")] = None,
    min_p: Annotated[Optional[float], typer.Option(help="Drop tokens less likely than min_p x the most likely one.")] = None,
    repetition_penalty: Annotated[Optional[float], typer.Option(help="> 1 discourages tokens already in prompt or output.")] = None,
    seed: Annotated[Optional[int], typer.Option(help="Same seed, same sampled output.")] = None,
    stop: Annotated[Optional[list[str]], typer.Option("--stop", help="Stop when this text appears (repeatable); it is cut from the output.")] = None,
    no_stream: Annotated[bool, typer.Option("--no-stream", help="Wait for the whole text instead of streaming it.")] = False,
    chat: Annotated[bool, typer.Option("--chat", help="Send the prompt as a user message, through the model's chat template.")] = False,
    beam_width: Annotated[Optional[int], typer.Option(help="Beam search with this many beams (up to the build's serving.max_beam_width); prints every beam, best first, once at the end.")] = None,
    length_penalty: Annotated[Optional[float], typer.Option(help="Beam search: a beam's score is its log-probability / length ** length_penalty (default 1).")] = None,
    early_stopping: Annotated[Optional[bool], typer.Option("--early-stopping/--no-early-stopping", help="Beam search: stop once beam_width beams have ended (default: stop when no running beam can beat them).", show_default=False)] = None,
    guide_type: Annotated[Optional[str], typer.Option(help="Structured output: json (any JSON object), json_schema, regex, ebnf_grammar (GBNF or Lark), lark_grammar or choice (a JSON list of strings); the guide is --guide or --guide-file.", show_default=False)] = None,
    guide: Annotated[Optional[str], typer.Option(help="The guide's text: a JSON schema, regex, grammar or JSON list of choices.", show_default=False)] = None,
    guide_file: Annotated[Optional[Path], typer.Option(exists=True, dir_okay=False, help="Read the guide's text from this file instead.", show_default=False)] = None,
    lora_name: Annotated[Optional[str], typer.Option(help="Run under this LoRA adapter of the model (its `adapters:` name; docs/lora.md).", show_default=False)] = None,
) -> None:
    """Generate text from a served model, printing tokens as they arrive (gRPC streaming)."""
    from llmc.serve import generate_to

    params = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                  repetition_penalty=repetition_penalty, seed=seed, stop_words=stop or None, beam_width=beam_width,
                  length_penalty=length_penalty, early_stopping=early_stopping, guided_decoding_guide_type=guide_type,
                  guided_decoding_guide=guide_file.read_text() if guide_file else guide, lora_name=lora_name)
    generate_to(sys.stdout, prompt, url=url, model=model, stream=not no_stream, chat=chat, **params)


@app.command()
@friendly
def bench(
    build_dir: Annotated[Optional[Path], typer.Argument(help="A build folder to serve for the run (or pass --url).", show_default=False)] = None,
    url: Annotated[Optional[str], typer.Option(help="Benchmark a running server at this gRPC address instead.")] = None,
    model: Annotated[Optional[str], typer.Option(help="Model name (default: the server's only ready model).")] = None,
    concurrency: Annotated[int, typer.Option(min=1, help="Streams in flight at once.")] = 16,
    requests: Annotated[Optional[int], typer.Option(min=1, help="Requests in the concurrent run (default: 2 x concurrency).")] = None,
    prompt_words: Annotated[int, typer.Option(min=4, help="Prompt length in words, at least 4 (the server reports tokens); every request gets its own prompt.")] = 96,
    max_tokens: Annotated[int, typer.Option(min=1, help="Tokens generated per request (end ids ignored).")] = 64,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Also write the results here.")] = None,
    serving_env: Annotated[Optional[Path], typer.Option(help="The venv model.py runs in (as for llmc serve).")] = None,
    sweep: Annotated[Optional[str], typer.Option(help="Concurrency levels to sweep instead, e.g. 1,2,4,8,16 (2 x level requests each).", show_default=False)] = None,
    plot: Annotated[Optional[Path], typer.Option(help="With --sweep: write a PNG of throughput and latency against concurrency.", show_default=False)] = None,
    shared_prefix: Annotated[int, typer.Option(min=0, help="Start every prompt with the same system prompt of about this many tokens (prefix caching); each run has its own.")] = 0,
) -> None:
    """Measure a served model: a sequential baseline, then concurrent streams, in one run (or a concurrency sweep).

    Prints time to first token, inter-token latency and request latency (p50 / p90 / p99), tokens/s and errors, and the last run's throughput as a multiple of the first (sequential) one. With BUILD_DIR a server is started on free ports and stopped afterwards.
    """
    import json

    from llmc.console import bench_table, out
    from llmc.errors import UnsupportedError
    from llmc.serve import bench as run_bench

    if (build_dir is None) == (url is None):
        raise UnsupportedError("pass a BUILD_DIR to serve for the benchmark, or --url of a running server (not both)")
    levels = None
    if sweep is not None:
        try:
            levels = sorted({int(v) for v in sweep.split(",") if v.strip()})
        except ValueError:
            levels = []
        if not levels or levels[0] < 1:
            raise UnsupportedError(f"--sweep {sweep!r}: give positive concurrency levels separated by commas, e.g. 1,2,4,8")
    if plot is not None and levels is None:
        raise UnsupportedError("--plot draws a concurrency sweep: add --sweep, e.g. --sweep 1,2,4,8,16")
    results = run_bench(build_dir, url=url, model=model, concurrency=concurrency, num_requests=requests or 2 * concurrency,
                        prompt_words=prompt_words, max_tokens=max_tokens, serving_env=serving_env, sweep=levels,
                        shared_prefix=shared_prefix)
    out.print(bench_table(results))
    last = levels[-1] if levels else concurrency
    out.print(f"throughput at concurrency {last}: {results['throughput_ratio']:.2f}x the first run's")
    if plot is not None:
        from llmc.serve import plot_sweep

        out.print(f"plot: {plot_sweep(results, plot)}")
    for name, r in results.items():
        if isinstance(r, dict) and r.get("first_error"):
            out.print(f"[red]{name}: {r['errors']} error(s)[/], first: {r['first_error']}")
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(results, indent=2) + "\n")
