"""`llmc k8s`: Kubernetes manifests that run Triton replicas on a build's repository in object storage.

    deployment.yaml          Triton (the pinned stock image, or --image) on the s3:// repository, explicit
                             model control with the model loaded at start, probes on /v2/health/ready and
                             /live, requests and limits (a GPU for tensorrt), a preStop pause and a grace
                             period that let in-flight streams drain, anti-affinity across nodes
    service.yaml             HTTP, gRPC and metrics ports
    hpa.yaml                 a HorizontalPodAutoscaler on llmc's own gauges per pod: the waiting queue
                             (llmc_requests_waiting) and KV cache use (llmc_kv_cache_usage_ratio)
    prometheus-adapter.yaml  the Prometheus adapter rules that expose those gauges as custom metrics
    pdb.yaml                 a PodDisruptionBudget: one replica down at a time
    servicemonitor.yaml      Prometheus scrapes the metrics port (prometheus-operator)
    kserve.yaml              with kserve=True: a KServe ServingRuntime + InferenceService instead of the
                             Deployment, Service, HPA and PDB (KServe makes and scales those itself)

The manifests are built as plain data and written with PyYAML (no text templates: nothing to
quote or indent by hand); tests validate them against the Kubernetes OpenAPI schemas offline
(kubernetes-validate). AWS credentials come from a Secret the operator creates (`secret`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from llmc.fleet.store import is_remote, parse_s3
from llmc.triton_server import NO_AUTO_COMPLETE

# Triton 2.53 (NGC 24.12), Ubuntu 24.04 with Python 3.12: the first stock container whose Python takes the
# runtime's onnxruntime wheels (24.10, the 2.51 llmc tests with from nvidia-pytriton, has Python 3.10, which
# onnxruntime stopped building for at 1.23). One image serves both targets: ONNX Runtime builds on CPU,
# TensorRT builds on the GPU. The model's Python packages come with the repository (the build's
# execution_env section, Triton's EXECUTION_ENV_PATH), not the image.
IMAGE = "nvcr.io/nvidia/tritonserver:24.12-py3"
IMAGE_PYTHON = "3.12"
PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002}
DRAIN_SECONDS = 30  # Triton's --exit-timeout-secs: streams in flight finish before it stops
PRESTOP_SECONDS = 10  # endpoints drop the pod before Triton stops accepting requests
KUBERNETES_VERSIONS = ("1.29", "1.33")  # the oldest and newest the manifests are validated against (tests)
HPA_METRICS = {"llmc_requests_waiting": "2", "llmc_kv_cache_usage_ratio": "800m"}  # per-pod average targets


@dataclass(frozen=True)
class K8sOptions:
    name: str  # the served model (the build's)
    repository: str  # s3://...
    target: str = "onnxruntime"
    replicas: int = 2
    max_replicas: int = 8
    gpu: bool = False
    cpu: str = "2"
    memory: str = "4Gi"
    namespace: str | None = None
    secret: str = "llmc-s3"  # keys AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY (and AWS_DEFAULT_REGION)
    packed_python: str | None = None  # the Python the build's packed serving environment is for; None: none packed
    image: str = IMAGE
    ranks: int = 1  # the model's tensor-parallel ranks (processes in the pod, one core each at least)

    def check(self) -> None:
        if not is_remote(self.repository):
            raise ValueError(f"--repository {self.repository}: replicas read one shared repository, "
                             "give its s3:// URL (llmc deploy --repository publishes it)")
        parse_s3(self.repository)
        if self.target == "tensorrt" and not self.gpu:
            raise ValueError(f"{self.name} is a TensorRT build: its replicas need a GPU (drop --cpu)")
        if self.image == IMAGE and self.packed_python is None:
            raise ValueError(f"{self.name} carries no serving environment, and the stock image {IMAGE} has none of "
                             "its Python packages: build it with an execution_env section (the packages travel in "
                             "the repository), or pass --image with an image that has its requirements.txt installed")
        if self.image == IMAGE and self.packed_python != IMAGE_PYTHON:
            raise ValueError(f"{self.name}'s serving environment is for Python {self.packed_python} "
                             f"(execution_env.python), and {IMAGE} has Python {IMAGE_PYTHON}: pass --image with a "
                             f"Triton image of Python {self.packed_python}, or build with execution_env.python: "
                             f"'{IMAGE_PYTHON}'")
        if self.ranks > 1 and _cores(self.cpu) < self.ranks:
            raise ValueError(f"--cpu {self.cpu}: {self.name} is split over {self.ranks} ranks, each a process with a "
                             f"core of its own at least: ask for {self.ranks} or more")
        if not 1 <= self.replicas <= self.max_replicas:
            raise ValueError(f"--replicas {self.replicas}: must be between 1 and --max-replicas {self.max_replicas}")


def _cores(quantity: str) -> float:
    """A Kubernetes CPU quantity ("2", "1.5", "500m") in cores."""
    return float(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


# A split model's ranks sum through a POSIX shared-memory segment (runtime/kernels/collective.py): /dev/shm as a
# memory-backed volume, since a container's own /dev/shm is 64 MiB by default (Triton's Python backend uses it too).
SHM_VOLUME = {"name": "dshm", "emptyDir": {"medium": "Memory"}}


def _meta(opts: K8sOptions, name: str | None = None) -> dict:
    meta = {"name": name or f"llmc-{opts.name}", "labels": _labels(opts)}
    if opts.namespace:
        meta["namespace"] = opts.namespace
    return meta


def _labels(opts: K8sOptions) -> dict:
    return {"app.kubernetes.io/name": "llmc", "app.kubernetes.io/instance": opts.name}


def triton_container(opts: K8sOptions, repository: str) -> dict:
    args = [f"--model-repository={repository}", "--model-control-mode=explicit", f"--load-model={opts.name}",
            f"--http-port={PORTS['http']}", f"--grpc-port={PORTS['grpc']}", f"--metrics-port={PORTS['metrics']}",
            "--allow-metrics=true", f"--exit-timeout-secs={DRAIN_SECONDS}", NO_AUTO_COMPLETE]
    resources = {"requests": {"cpu": opts.cpu, "memory": opts.memory}, "limits": {"memory": opts.memory}}
    if opts.gpu:
        resources["limits"]["nvidia.com/gpu"] = opts.ranks  # a split TensorRT model runs a rank per GPU
    env = [{"name": key, "valueFrom": {"secretKeyRef": {"name": opts.secret, "key": key, "optional": key.endswith("REGION")}}}
           for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")]
    probe = {"httpGet": {"path": "/v2/health/ready", "port": "http"}, "periodSeconds": 5, "failureThreshold": 3}
    return {
        "name": "triton", "image": opts.image, "command": ["tritonserver"], "args": args, "env": env,
        "ports": [{"name": n, "containerPort": p} for n, p in PORTS.items()], "resources": resources,
        "readinessProbe": probe,
        "livenessProbe": {"httpGet": {"path": "/v2/health/live", "port": "http"}, "periodSeconds": 10,
                          "failureThreshold": 3},
        # a model load (the copy from the bucket, the session) may take minutes: no liveness kill meanwhile
        "startupProbe": {**probe, "periodSeconds": 10, "failureThreshold": 60},
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SECONDS)]}}},
        **({"volumeMounts": [{"name": SHM_VOLUME["name"], "mountPath": "/dev/shm"}]} if opts.ranks > 1 else {}),
    }


def deployment(opts: K8sOptions) -> dict:
    selector = _labels(opts)
    anti = {"weight": 100, "podAffinityTerm": {"labelSelector": {"matchLabels": selector},
                                               "topologyKey": "kubernetes.io/hostname"}}
    pod = {"containers": [triton_container(opts, opts.repository)],
           "terminationGracePeriodSeconds": PRESTOP_SECONDS + DRAIN_SECONDS + 15,
           "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [anti]}},
           **({"volumes": [SHM_VOLUME]} if opts.ranks > 1 else {})}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(opts),
            "spec": {"replicas": opts.replicas, "selector": {"matchLabels": selector},
                     "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
                     "template": {"metadata": {"labels": selector}, "spec": pod}}}


def service(opts: K8sOptions) -> dict:
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(opts),
            "spec": {"selector": _labels(opts),
                     "ports": [{"name": n, "port": p, "targetPort": n} for n, p in PORTS.items()]}}


def autoscaler(opts: K8sOptions) -> dict:
    metrics = [{"type": "Pods", "pods": {"metric": {"name": name},
                                         "target": {"type": "AverageValue", "averageValue": value}}}
               for name, value in HPA_METRICS.items()]
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": _meta(opts),
            "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": f"llmc-{opts.name}"},
                     "minReplicas": opts.replicas, "maxReplicas": opts.max_replicas, "metrics": metrics,
                     # a new replica loads for a while: scale down slowly, so load spikes do not flap it
                     "behavior": {"scaleDown": {"stabilizationWindowSeconds": 300}}}}


def adapter_rules(opts: K8sOptions) -> dict:
    """The Prometheus adapter's rules (its config.yaml) exposing the gauges per pod, in a ConfigMap."""
    rules = [{"seriesQuery": f'{name}{{namespace!="",pod!=""}}',
              "resources": {"overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}},
              "name": {"matches": f"^{name}$", "as": name},
              "metricsQuery": "max(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)"}
             for name in HPA_METRICS]
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(opts, f"llmc-{opts.name}-adapter-rules"),
            "data": {"config.yaml": yaml.safe_dump({"rules": rules}, sort_keys=False)}}


def disruption_budget(opts: K8sOptions) -> dict:
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": _meta(opts),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": _labels(opts)}}}


def service_monitor(opts: K8sOptions) -> dict:
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor", "metadata": _meta(opts),
            "spec": {"selector": {"matchLabels": _labels(opts)},
                     "endpoints": [{"port": "metrics", "path": "/metrics", "interval": "15s"}]}}


def kserve(opts: K8sOptions) -> list[dict]:
    """A ServingRuntime running this Triton on the model KServe copies to /mnt/models, and the
    InferenceService pointing at the bucket (KServe makes the Deployment, Service and autoscaler)."""
    where = parse_s3(opts.repository)
    container = triton_container(opts, "/mnt/models")
    container.pop("startupProbe")
    container["name"] = "kserve-container"
    runtime = {"apiVersion": "serving.kserve.io/v1alpha1", "kind": "ServingRuntime",
               "metadata": _meta(opts, f"llmc-{opts.name}-triton"),
               "spec": {"supportedModelFormats": [{"name": "llmc", "version": "1", "autoSelect": False}],
                        "protocolVersions": ["v2", "grpc-v2"], "containers": [container],
                        **({"volumes": [SHM_VOLUME]} if opts.ranks > 1 else {})}}
    service_ = {"apiVersion": "serving.kserve.io/v1beta1", "kind": "InferenceService", "metadata": _meta(opts),
                "spec": {"predictor": {"minReplicas": opts.replicas, "maxReplicas": opts.max_replicas,
                                       "model": {"modelFormat": {"name": "llmc"}, "runtime": f"llmc-{opts.name}-triton",
                                                 "storageUri": f"s3://{where.bucket}/{where.prefix}".rstrip("/")}}}}
    return [runtime, service_]


def manifests(opts: K8sOptions, with_kserve: bool = False) -> dict[str, list[dict]]:
    """File name -> the resources it holds."""
    opts.check()
    files = {"servicemonitor.yaml": [service_monitor(opts)], "prometheus-adapter.yaml": [adapter_rules(opts)]}
    if with_kserve:
        return {"kserve.yaml": kserve(opts), **files}
    return {"deployment.yaml": [deployment(opts)], "service.yaml": [service(opts)], "hpa.yaml": [autoscaler(opts)],
            "pdb.yaml": [disruption_budget(opts)], **files}


def write_manifests(opts: K8sOptions, output: Path, with_kserve: bool = False) -> list[Path]:
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    written = []
    for name, resources in manifests(opts, with_kserve).items():
        path = output / name
        path.write_text(yaml.safe_dump_all(resources, sort_keys=False))
        written.append(path)
    return written


def options_from_build(build_dir: Path, repository: str, **overrides) -> K8sOptions:
    """K8sOptions for a build: its model's name, target (a TensorRT build gets a GPU) and packed environment."""
    from llmc.runtime.manifest import RepositoryManifest
    from llmc.triton_server import find_repository

    models = [d for d in find_repository(build_dir).iterdir() if (d / "config.pbtxt").is_file()]
    manifest = RepositoryManifest.load(models[0] / "1")
    gpu = overrides.pop("gpu", None)
    packed = manifest.execution_env.python if manifest.execution_env is not None else None
    return K8sOptions(name=manifest.name, repository=repository, target=manifest.target, packed_python=packed,
                      gpu=manifest.target == "tensorrt" if gpu is None else gpu, ranks=manifest.tensor_parallel,
                      **overrides)
