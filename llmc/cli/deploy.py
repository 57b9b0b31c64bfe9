"""Commands that ship a build: deploy, k8s."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from llmc.cli.app import app, friendly


@app.command()
@friendly
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
    from llmc.fleet.deploy import DeployError, deploy as run_deploy

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


@app.command()
@friendly
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
    image: Annotated[Optional[str], typer.Option(help="The Triton image (default: NGC's stock tritonserver 24.12-py3, Python 3.12, which needs a build with an execution_env section for Python 3.12).", show_default=False)] = None,
) -> None:
    """Write Kubernetes manifests for Triton replicas serving the build from object storage.

    A Deployment (the pinned stock Triton image running the packages the build packed with its execution_env section, or --image; explicit model control with the model loaded at start, readiness and liveness probes, resources, a preStop pause and a grace period for in-flight streams, anti-affinity), a Service, a HorizontalPodAutoscaler on llmc's queue and KV-cache gauges with the Prometheus adapter rules, a PodDisruptionBudget and a ServiceMonitor.
    """
    from llmc.console import out
    from llmc.errors import UnsupportedError
    from llmc.fleet.k8s import IMAGE, options_from_build, write_manifests

    try:
        opts = options_from_build(build_dir, repository, replicas=replicas, max_replicas=max_replicas, gpu=gpu,
                                  cpu=cpu, memory=memory, namespace=namespace, secret=secret, image=image or IMAGE)
        files = write_manifests(opts, output, with_kserve=kserve)
    except ValueError as err:
        raise UnsupportedError(str(err)) from None
    out.print(f"[green]wrote[/] {', '.join(p.name for p in files)} to {output}")
    out.print(f"  kubectl apply -f {output}   (after: kubectl create secret generic {secret} "
              "--from-literal=AWS_ACCESS_KEY_ID=... --from-literal=AWS_SECRET_ACCESS_KEY=...)")
