"""`llmc k8s` manifests, validated offline against the Kubernetes OpenAPI schemas (kubernetes-validate)
for the oldest and newest supported versions. Custom resources have no schema there. The
ServiceMonitor is validated against prometheus-operator's CRD schema as cloudcoil's generated
pydantic models carry it (`_validate_crd`); KServe's resources have no such package, so their
embedded Kubernetes parts (metadata, the Triton container) are validated against the Kubernetes
schemas' definitions."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from llmc.fleet.k8s import IMAGE_PYTHON, KUBERNETES_VERSIONS, K8sOptions, manifests, options_from_build, write_manifests

REPOSITORY = "s3://http://minio.storage:9000/models/repo"
CORE = {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget", "ConfigMap"}


def options(**kw) -> K8sOptions:
    """Options for a build whose packed environment suits the stock image."""
    return K8sOptions(packed_python=IMAGE_PYTHON, **kw)


def _definition_validator(version: str, definition: str):
    """A validator for one definition of kubernetes-validate's bundled schemas (strict: unknown fields fail)."""
    import importlib.resources
    import json

    import jsonschema
    from referencing import Registry, Resource

    folder = importlib.resources.files("kubernetes_validate") / "kubernetes-json-schema"
    schema_dir = next(d for d in folder.iterdir() if d.name == f"v{version}.0-local-strict")
    definitions = Resource.from_contents(json.loads((schema_dir / "_definitions.json").read_text()))
    registry = Registry().with_resource("_definitions.json", definitions)
    return jsonschema.validators.Draft202012Validator({"$ref": f"_definitions.json#/$defs/{definition}"},
                                                      registry=registry)


def _validate_crd(resource: dict) -> None:
    """`resource` against its custom resource definition's schema, as strictly as the Kubernetes
    kinds: the generated model checks types and required fields; a field it does not know (which
    pydantic drops) makes the round trip differ."""
    from cloudcoil.models.prometheus_operator.v1 import ServiceMonitor

    models = {("monitoring.coreos.com/v1", "ServiceMonitor"): ServiceMonitor}
    model = models[resource["apiVersion"], resource["kind"]].model_validate(resource)
    back = model.model_dump(by_alias=True, exclude_unset=True, mode="json")
    if back != resource:
        raise ValueError(f"{resource['kind']}: fields its schema does not have: "
                         f"{_unknown(resource, back) or 'values changed by validation'}")


def _unknown(given, kept, path: str = "") -> list[str]:
    if isinstance(given, dict) and isinstance(kept, dict):
        return [p for k, v in given.items()
                for p in ([f"{path}.{k}"] if k not in kept else _unknown(v, kept[k], f"{path}.{k}"))]
    if isinstance(given, list) and isinstance(kept, list):
        return [p for i, (a, b) in enumerate(zip(given, kept)) for p in _unknown(a, b, f"{path}[{i}]")]
    return []


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("with_kserve, gpu, ranks", [(False, False, 1), (False, True, 1), (True, False, 1),
                                                     (False, False, 2), (True, False, 2)])
def test_manifests_validate_against_the_kubernetes_schemas(version, with_kserve, gpu, ranks):
    import kubernetes_validate

    resources = [r for rs in manifests(options(name="smollm2", repository=REPOSITORY, gpu=gpu, replicas=3,
                                               ranks=ranks), with_kserve).values() for r in rs]
    pods = [r["spec"]["template"]["spec"] if r["kind"] == "Deployment" else r["spec"] for r in resources
            if r["kind"] in ("Deployment", "ServingRuntime")]
    for pod in pods:  # a split model's ranks sum through /dev/shm: memory-backed, not the container's 64 MiB
        mounts = [m["mountPath"] for m in pod["containers"][0].get("volumeMounts", [])]
        assert (mounts == ["/dev/shm"] and pod["volumes"][0]["emptyDir"] == {"medium": "Memory"}) == (ranks > 1)
    kinds = {r["kind"] for r in resources}
    assert kinds == ({"ServingRuntime", "InferenceService", "ServiceMonitor", "ConfigMap"} if with_kserve
                     else CORE | {"ServiceMonitor"})
    meta = _definition_validator(version, "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta")
    container = _definition_validator(version, "io.k8s.api.core.v1.Container")
    for resource in resources:
        if resource["kind"] in CORE:
            kubernetes_validate.validate(resource, version, strict=True)
            continue
        with pytest.raises(kubernetes_validate.SchemaNotFoundError):  # a custom resource: no bundled schema
            kubernetes_validate.validate(resource, version, strict=True)
        if resource["kind"] == "ServiceMonitor":
            _validate_crd(resource)
        meta.validate(resource["metadata"])
        for c in resource["spec"].get("containers", []):
            container.validate(c)


def test_a_broken_manifest_fails_validation():
    import kubernetes_validate

    deployment = manifests(options(name="m", repository=REPOSITORY))["deployment.yaml"][0]
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["port"] = [8000]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[-1], strict=True)
    import jsonschema

    runtime = manifests(options(name="m", repository=REPOSITORY), with_kserve=True)["kserve.yaml"][0]
    runtime["spec"]["containers"][0]["argz"] = []  # a custom resource's container is checked as a Container
    with pytest.raises(jsonschema.ValidationError, match="argz"):
        _definition_validator(KUBERNETES_VERSIONS[-1], "io.k8s.api.core.v1.Container").validate(
            runtime["spec"]["containers"][0])

    import pydantic

    monitor = manifests(options(name="m", repository=REPOSITORY))["servicemonitor.yaml"][0]
    _validate_crd(monitor)
    typo = {**monitor, "spec": {**monitor["spec"], "endpoints": [{**monitor["spec"]["endpoints"][0], "intervall": "5s"}]}}
    with pytest.raises(ValueError, match=r"spec\.endpoints\[0\]\.intervall"):
        _validate_crd(typo)
    wrong = {**monitor, "spec": {**monitor["spec"], "endpoints": "metrics"}}  # a list in the schema
    with pytest.raises(pydantic.ValidationError):
        _validate_crd(wrong)


def test_the_deployment_serves_the_bucket_and_drains(tmp_path):
    files = write_manifests(options(name="smollm2", repository=REPOSITORY, gpu=True), tmp_path)
    assert sorted(p.name for p in files) == ["deployment.yaml", "hpa.yaml", "pdb.yaml", "prometheus-adapter.yaml",
                                             "service.yaml", "servicemonitor.yaml"]
    deployment = yaml.safe_load((tmp_path / "deployment.yaml").read_text())
    pod = deployment["spec"]["template"]["spec"]
    triton = pod["containers"][0]
    assert f"--model-repository={REPOSITORY}" in triton["args"] and "--load-model=smollm2" in triton["args"]
    assert "--model-control-mode=explicit" in triton["args"] and "--disable-auto-complete-config" in triton["args"]
    assert triton["resources"]["limits"]["nvidia.com/gpu"] == 1
    drain = int(next(a for a in triton["args"] if a.startswith("--exit-timeout-secs=")).split("=")[1])
    pause = int(triton["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pod["terminationGracePeriodSeconds"] > pause + drain  # streams drain before the kubelet kills
    rules = yaml.safe_load(yaml.safe_load((tmp_path / "prometheus-adapter.yaml").read_text())["data"]["config.yaml"])
    hpa = yaml.safe_load((tmp_path / "hpa.yaml").read_text())
    assert [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]] == [r["name"]["as"] for r in rules["rules"]]


def test_options_refuse_what_cannot_run(tiny_build):
    with pytest.raises(ValueError, match="give its s3:// URL"):
        options(name="m", repository="/srv/models").check()
    with pytest.raises(ValueError, match="TensorRT build: its replicas need a GPU"):
        options(name="m", repository=REPOSITORY, target="tensorrt").check()
    opts = options_from_build(tiny_build.output, REPOSITORY, replicas=2)
    assert (opts.name, opts.target, opts.gpu, opts.packed_python) == ("tiny", "onnxruntime", False, None)
    with pytest.raises(ValueError, match=r"tiny carries no serving environment, and the stock image .*24\.12-py3 has "
                                         r"none of its Python packages: build it with an execution_env section"):
        opts.check()
    options_from_build(tiny_build.output, REPOSITORY, image="registry.example/triton-llmc:1").check()  # packages in it
    with pytest.raises(ValueError, match=r"m's serving environment is for Python 3\.10 \(execution_env\.python\), and "
                                         r".* has Python 3\.12: pass --image"):
        K8sOptions(name="m", repository=REPOSITORY, packed_python="3.10").check()
    K8sOptions(name="m", repository=REPOSITORY, packed_python="3.10", image="registry.example/triton-py310:1").check()
    with pytest.raises(ValueError, match=r"--cpu 1500m: m is split over 2 ranks, .* ask for 2 or more"):
        options(name="m", repository=REPOSITORY, ranks=2, cpu="1500m").check()
    options(name="m", repository=REPOSITORY, ranks=2, cpu="2").check()


def test_cli_writes_the_manifests(tiny_build, tmp_path):
    llmc = Path(sys.executable).parent / "llmc"
    run = subprocess.run([str(llmc), "k8s", str(tiny_build.output), "--repository", REPOSITORY, "--output",
                          str(tmp_path / "k8s"), "--replicas", "2", "--kserve", "--image", "registry.example/triton:1"],
                         capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert sorted(p.name for p in (tmp_path / "k8s").iterdir()) == ["kserve.yaml", "prometheus-adapter.yaml",
                                                                      "servicemonitor.yaml"]
    runtime, service = yaml.safe_load_all((tmp_path / "k8s" / "kserve.yaml").read_text())
    assert runtime["spec"]["containers"][0]["image"] == "registry.example/triton:1"
    assert service["spec"]["predictor"]["model"]["storageUri"] == "s3://models/repo"
    assert "--load-model=tiny" in runtime["spec"]["containers"][0]["args"]
