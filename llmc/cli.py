"""The `llmc` command line: a thin layer over `llmc.compiler`, `llmc.serve` and `llmc.deploy`."""

from __future__ import annotations

import functools
import signal
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from llmc.errors import LlmcError

app = typer.Typer(
    name="llmc",
    help="Compile HuggingFace causal LMs into verified ONNX artifacts (and serve them on Triton).\n\n"
    "Start with: llmc build model.yaml   (the smallest model.yaml is `name:` and `source:`)",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
)
_state = {"debug": False}

SpecArg = Annotated[Path, typer.Argument(help="The build spec (model.yaml).", show_default=False)]
OutputOpt = Annotated[Optional[Path], typer.Option("--output", "-o", help="Output folder (default: the spec's `output`, else build/<name>).")]


@app.callback()
def _root(debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks for errors.")] = False) -> None:
    _state["debug"] = debug


def _friendly(fn):
    """Turn LlmcError into one readable line on stderr and the error's exit code."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from rich.text import Text

        from llmc.console import console

        try:
            return fn(*args, **kwargs)
        except LlmcError as err:
            if _state["debug"]:
                raise
            console.print(Text.assemble(("error: ", "bold red"), str(err)), soft_wrap=True)
            raise typer.Exit(err.exit_code) from None
        except KeyboardInterrupt:
            console.print("[yellow]interrupted[/]: previous output left untouched")
            raise typer.Exit(130) from None

    return wrapper


def _run_build(spec_path: Path, output: Optional[Path], until: str, force: set[str]) -> None:
    from llmc.compiler import build, load_spec
    from llmc.console import RichReporter, out, summary_table

    spec = load_spec(spec_path)
    with RichReporter() as reporter:
        result = build(spec, output=output, until=until, force=force, reporter=reporter)
    out.print(summary_table(result))


@app.command()
@_friendly
def build(
    spec: SpecArg,
    output: OutputOpt = None,
    force: Annotated[bool, typer.Option("--force", help="Run every stage, even unchanged ones.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the build plan (stages, precision, attention, TensorRT profiles, memory estimate) from the spec and the checkpoint's config, and exit; needs no GPU.")] = False,
) -> None:
    """Build a spec: load the checkpoint, export to ONNX, verify against PyTorch, quantize (quantization.mode), build the TensorRT engine (target: tensorrt), package a Triton model repository.

A TensorRT build needs TensorRT and an NVIDIA GPU: the engine gets a prefill and a decode optimization profile from `limits`, the `tensorrt:` options (workspace, optimization level, hardware/version compatibility, timing cache in <output>/engine/timing.cache), and is compared with ONNX Runtime (Polygraphy) before it is packaged with KIND_GPU instances.

    A quantized build measures perplexity (held-out text), greedy agreement, size and decode speed against the unquantized graph and fails (exit code 9) when perplexity rises more than quantization.max_perplexity_increase; `llmc inspect` shows that report.

    Unchanged stages are reused from the previous output; the output folder is replaced atomically, so a failed or interrupted build leaves the previous one intact.
    """
    if dry_run:
        from llmc.compiler import load_spec, plan_build
        from llmc.compiler.inspect import Section
        from llmc.console import out, sections_table

        for table in sections_table([Section(f"build plan: {spec}", plan_build(load_spec(spec)).rows())]):
            out.print(table)
        return
    _run_build(spec, output, "package", {"export", "verify", "quantize", "engine"} if force else set())


@app.command()
@_friendly
def export(spec: SpecArg, output: OutputOpt = None,
           force: Annotated[bool, typer.Option("--force", help="Export even if unchanged.")] = False) -> None:
    """Export only: checkpoint -> ONNX with explicit KV cache (no verification).

    Attention is lowered as `export.attention` says: `fused` (ONNX Runtime GroupQueryAttention, in-place KV), `reference` (plain opset-23 ops), `plugin` (TensorRT LlmcFusedAttention node, target: tensorrt) or `paged` (llmc.PagedAttention over block pools, packed tokens).
    """
    _run_build(spec, output, "export", {"export"} if force else set())


@app.command()
@_friendly
def verify(spec: SpecArg, output: OutputOpt = None) -> None:
    """Verify the spec's ONNX export against PyTorch (exports first if needed); for target: tensorrt, the engine against ONNX Runtime.

    The HF model runs each prompt alone; the graph runs as serving runs it: each prompt prefilled into its own KV slot, then all rows decoding side by side at their own positions. Prefill plus `verify.decode_steps` greedy steps at batch 1 and for a batch of 3 prompts of different lengths; fails (exit code 5) if any greedy token differs or |Δlogit| exceeds `verify.max_logit_diff`.

    A TensorRT build (re)builds its engine and compares it with ONNX Runtime driven the same way, by Polygraphy's comparator at the precision's tolerance (fp16: atol 0.25, rtol 0.02).
    """
    from llmc.compiler import load_spec
    from llmc.compiler.spec import Target

    tensorrt = load_spec(spec).target is Target.tensorrt
    _run_build(spec, output, "engine" if tensorrt else "verify", {"verify", "engine"} if tensorrt else {"verify"})


@app.command()
@_friendly
def inspect(path: Annotated[Path, typer.Argument(help="A build folder, a stage folder (export/, verify/) or an .onnx file.", show_default=False)]) -> None:
    """Show what an artifact holds: IO names and shapes, opset, KV layout, hashes, verify results, the quantization quality report."""
    from llmc.compiler import inspect_path
    from llmc.console import out, sections_table

    for table in sections_table(inspect_path(path)):
        out.print(table)


@app.command()
@_friendly
def serve(
    build_dir: Annotated[Optional[Path], typer.Argument(help="A build folder (or its model_repository/).", show_default=False)] = None,
    repository: Annotated[Optional[str], typer.Option(help="Serve this repository instead of a build: s3://\\[http://host:port/]bucket/prefix (AWS credentials from the environment), as `llmc deploy` publishes it.", show_default=False)] = None,
    http_port: Annotated[int, typer.Option(help="HTTP port (generate / generate_stream endpoints).")] = 8000,
    grpc_port: Annotated[int, typer.Option(help="gRPC port (tritonclient, llmc generate).")] = 8001,
    metrics_port: Annotated[int, typer.Option(help="Prometheus metrics port.")] = 8002,
    serving_env: Annotated[Optional[Path], typer.Option(help="The venv model.py runs in (default: $LLMC_SERVING_ENV or the .venv-serving made by scripts/setup.sh).")] = None,
    openai_port: Annotated[int, typer.Option(help="Port of the OpenAI-compatible API on 127.0.0.1 (0: none).")] = 9000,
    api_key: Annotated[Optional[str], typer.Option(envvar="LLMC_API_KEY", help="Require `Authorization: Bearer KEY` on the OpenAI API's /v1 routes.", show_default=False)] = None,
) -> None:
    """Serve a build on a local Triton Inference Server (127.0.0.1) until Ctrl-C or SIGTERM, with the OpenAI-compatible API in front of it (--openai-port).

    The server comes from the nvidia-pytriton wheel (assembled once under ~/.cache/llmc). Call it with `llmc generate`, tritonclient, or HTTP: curl -d '{"text_input": "Hi", "max_tokens": 16}' 127.0.0.1:8000/v2/models/NAME/generate
    """
    from llmc.errors import UnsupportedError
    from llmc.serve import serve_forever

    if (build_dir is None) == (repository is None):
        raise UnsupportedError("pass a BUILD_DIR, or --repository s3://... (not both)")
    serve_forever(build_dir or repository, http_port, grpc_port, metrics_port, serving_env, openai_port=openai_port,
                  api_key=api_key)


@app.command(name="openai")
@_friendly
def openai_api(
    url: Annotated[list[str], typer.Option("--url", help="A running Triton server's gRPC address (repeatable: requests go to the one with the fewest in flight).", show_default=False)],
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to bind.")] = 9000,
    api_key: Annotated[Optional[str], typer.Option(envvar="LLMC_API_KEY", help="Require `Authorization: Bearer KEY` on every /v1 route.", show_default=False)] = None,
) -> None:
    """Run the OpenAI-compatible API alone, in front of one or more running Triton servers (a sidecar or gateway), until Ctrl-C.

    /v1/models, /v1/completions, /v1/chat/completions (the build's chat template), /health. Servers that fail their health check are skipped until they recover.
    """
    from llmc.console import console
    from llmc.openai.server import run

    console.print(f"[green]OpenAI API[/] on http://{host}:{port}/v1 in front of {', '.join(url)}; Ctrl-C to stop")
    run(url, host=host, port=port, api_key=api_key)


@app.command()
@_friendly
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
) -> None:
    """Generate text from a served model, printing tokens as they arrive (gRPC streaming)."""
    from llmc.serve import generate_to

    params = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                  repetition_penalty=repetition_penalty, seed=seed, stop_words=stop or None)
    generate_to(sys.stdout, prompt, url=url, model=model, stream=not no_stream, chat=chat, **params)


@app.command()
@_friendly
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


@app.command()
@_friendly
def deploy(
    build_dir: Annotated[Path, typer.Argument(help="A build folder made by `llmc build`.", show_default=False)],
    repository: Annotated[str, typer.Option(help="The model repository the replicas serve: a folder, or s3://\\[http://host:port/]bucket/prefix (AWS credentials from the environment).", show_default=False)],
    url: Annotated[Optional[list[str]], typer.Option(help="A replica's gRPC address (repeat for each); it must run with --model-control-mode explicit. None: publish only, for replicas that start later.", show_default=False)] = None,
    model: Annotated[Optional[str], typer.Option(help="Which model of the build (default: its only one).")] = None,
    keep: Annotated[int, typer.Option(min=1, help="Version folders kept in the repository after a successful deploy.")] = 2,
    timeout: Annotated[float, typer.Option(min=1, help="Seconds the new version may take to become ready on a replica.")] = 300.0,
    lock_wait: Annotated[float, typer.Option(min=0, help="Seconds to wait for another deploy of the model to finish before giving up.")] = 60.0,
    break_lock: Annotated[bool, typer.Option("--break-lock", help="Break a deploy lock left by a deploy that died (check it is dead first).")] = False,
) -> None:
    """Deploy a build as version N+1 into a Triton model repository (a folder or an S3 bucket) and load it on every replica.

    Version N+1 is uploaded whole and checked (checksums on S3) before the config, written last, names it; then each --url replica loads it in turn through Triton's repository API, keeping version N serving until N+1 is ready. If any replica fails, every replica goes back to version N, the upload is removed, and the command exits with code 8 naming the replica and Triton's reason. A lock serializes deploys of one model.
    """
    from llmc.console import out
    from llmc.errors import ServingError
    from llmc.deploy import DeployError, deploy as run_deploy

    try:
        result = run_deploy(build_dir, repository, url or [], model=model, keep=keep, timeout=timeout,
                            lock_wait=lock_wait, break_lock=break_lock)
    except DeployError as err:
        raise ServingError(str(err)) from None
    if result.broke_lock:
        out.print(f"[yellow]{result.broke_lock}[/]")
    was = f" (was version {result.previous})" if result.previous else ""
    where = f"ready on {', '.join(result.replicas)}" if result.replicas else "published (no replica given to load it)"
    out.print(f"[green]deployed[/] {result.model} version {result.version}{was} to {repository}, {where} "
              f"in {result.seconds:.1f} s")


@app.command(name="pack-env")
@_friendly
def pack_env(
    build_dir: Annotated[Path, typer.Argument(help="A build folder made by `llmc build`.", show_default=False)],
    serving_env: Annotated[Optional[Path], typer.Option(help="The venv to pack (default: $LLMC_SERVING_ENV or the .venv-serving made by scripts/setup.sh).")] = None,
    model: Annotated[Optional[str], typer.Option(help="Which model of the build (default: its only one).")] = None,
) -> None:
    """Pack the serving environment into the build's repository (Triton's EXECUTION_ENV_PATH), so the Triton that loads it needs nothing installed.

    The archive (venv-pack) goes into <name>/1/serving_env.tar.gz and config.pbtxt points at it; `llmc deploy` carries it with the version. A venv's archive needs the same Python at the same path where it runs (docs/scaling.md). Run it again after each build.
    """
    from llmc.console import out
    from llmc.errors import ServingError
    from llmc.packenv import PackError, pack_env as run_pack
    from llmc.triton_server import TritonError

    try:
        result = run_pack(build_dir, serving_env, model)
    except (PackError, TritonError) as err:
        raise ServingError(str(err)) from None
    out.print(f"[green]packed[/] {result.archive} ({result.bytes / 2**20:.0f} MiB) in {result.seconds:.1f} s")


@app.command()
@_friendly
def k8s(
    build_dir: Annotated[Path, typer.Argument(help="A build folder made by `llmc build` (its model's name and target).", show_default=False)],
    repository: Annotated[str, typer.Option(help="The s3:// repository the replicas serve (where llmc deploy publishes).", show_default=False)],
    output: Annotated[Path, typer.Option("--output", "-o", help="Folder for the manifests.", show_default=False)],
    replicas: Annotated[int, typer.Option(min=1, help="Replicas at least (the autoscaler's minimum).")] = 2,
    max_replicas: Annotated[int, typer.Option(min=1, help="The autoscaler's maximum.")] = 8,
    gpu: Annotated[Optional[bool], typer.Option("--gpu/--cpu", help="A GPU per replica (default: for tensorrt builds).", show_default=False)] = None,
    cpu: Annotated[str, typer.Option(help="CPU request per replica.")] = "2",
    memory: Annotated[str, typer.Option(help="Memory request and limit per replica.")] = "4Gi",
    namespace: Annotated[Optional[str], typer.Option(help="Namespace of the resources (default: kubectl's).")] = None,
    secret: Annotated[str, typer.Option(help="The Secret holding AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (/ AWS_DEFAULT_REGION).")] = "llmc-s3",
    kserve: Annotated[bool, typer.Option("--kserve", help="A KServe ServingRuntime + InferenceService instead of Deployment, Service, HPA and PDB.")] = False,
) -> None:
    """Write Kubernetes manifests for Triton replicas serving the build from object storage.

    A Deployment (pinned Triton image, explicit model control with the model loaded at start, readiness and liveness probes, resources, a preStop pause and a grace period for in-flight streams, anti-affinity), a Service, a HorizontalPodAutoscaler on llmc's queue and KV-cache gauges with the Prometheus adapter rules, a PodDisruptionBudget and a ServiceMonitor.
    """
    from llmc.console import out
    from llmc.errors import UnsupportedError
    from llmc.k8s import options_from_build, write_manifests

    try:
        opts = options_from_build(build_dir, repository, replicas=replicas, max_replicas=max_replicas, gpu=gpu,
                                  cpu=cpu, memory=memory, namespace=namespace, secret=secret)
        files = write_manifests(opts, output, with_kserve=kserve)
    except ValueError as err:
        raise UnsupportedError(str(err)) from None
    out.print(f"[green]wrote[/] {', '.join(p.name for p in files)} to {output}")
    out.print(f"  kubectl apply -f {output}   (after: kubectl create secret generic {secret} "
              "--from-literal=AWS_ACCESS_KEY_ID=... --from-literal=AWS_SECRET_ACCESS_KEY=...)")


def _interrupt(signum, frame):  # SIGTERM unwinds like Ctrl-C so staging folders are removed
    raise KeyboardInterrupt


def main() -> None:
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        app()
    except KeyboardInterrupt:  # an interrupt that surfaced outside a command body (e.g. during teardown)
        sys.exit(130)


if __name__ == "__main__":
    sys.exit(main())
