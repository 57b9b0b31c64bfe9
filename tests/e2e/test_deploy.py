"""`llmc deploy` against a real Triton server in explicit model-control mode: a first deploy, a
version swap under streaming load with zero failed requests, and a broken build rolled back while
the previous version keeps serving."""

import shutil
from pathlib import Path

import pytest

from serving_rig import BackgroundLoad, serving_env
from llmc.client import Client
from llmc.fleet.deploy import DeployError, deploy, versions
from llmc.triton_server import TritonServer, assemble

pytestmark = pytest.mark.triton


@pytest.fixture(scope="module")
def explicit_server(tmp_path_factory):
    env = serving_env()
    root = tmp_path_factory.mktemp("deploy")
    (root / "repository").mkdir()
    with TritonServer(root / "repository", server_dir=assemble(root / "server"), serving_env=env,
                      log_path=root / "server.log", extra_args=("--model-control-mode", "explicit")) as srv:
        yield srv


def test_deploy_swaps_versions_under_load_and_rolls_back_a_broken_build(tiny_build, explicit_server, tmp_path):
    import time

    import tritonclient.grpc as grpcclient

    repository, url = explicit_server.repository, explicit_server.grpc_url
    first = deploy(tiny_build.output, repository, url)
    assert (first.model, first.version, first.previous) == ("tiny", 1, None)
    triton = grpcclient.InferenceServerClient(url)
    assert triton.is_model_ready("tiny", "1")
    assert Client(url, "tiny").complete("hello", max_tokens=4).output_ids

    with BackgroundLoad(url, workers=4) as load:
        time.sleep(1.0)
        second = deploy(tiny_build.output, repository, url)
        before = len(load.ok)
        deadline = time.monotonic() + 30
        while len(load.ok) < before + 8 and time.monotonic() < deadline:  # traffic on the new version
            time.sleep(0.1)
    assert (second.version, second.previous) == (2, 1)
    assert load.errors == [] and len(load.ok) >= before + 8
    assert triton.is_model_ready("tiny", "2") and not triton.is_model_ready("tiny", "1")

    broken = tmp_path / "broken"
    shutil.copytree(tiny_build.output, broken)
    (broken / "model_repository" / "tiny" / "1" / "manifest.json").write_text("{}")
    with pytest.raises(DeployError, match=r"tiny version 3 failed to load on 127\.0\.0\.1:\d+: .*ManifestError.*; "
                       r"rolled back 1 of 1 replica\(s\), version 2 keeps serving"):
        deploy(broken, repository, url)
    assert versions(repository / "tiny") == [1, 2]
    assert triton.is_model_ready("tiny", "2")
    assert Client(url, "tiny").complete("still here", max_tokens=4).output_ids

    third = deploy(tiny_build.output, repository, url, keep=2)
    assert third.version == 3 and versions(repository / "tiny") == [2, 3]


def test_a_version_that_served_a_cancelled_stream_unloads_at_once(tiny_build, explicit_server):
    """A client cancels its gRPC stream mid-generation: the model still gives Triton the request's final flag, so
    the version unloads in about a second (without it Triton held the request, and the version, for good)."""
    import queue
    import time

    import tritonclient.grpc as grpcclient

    from llmc.client.generation import make_inputs

    url = explicit_server.grpc_url
    if not versions(explicit_server.repository / "tiny"):  # the test run alone
        deploy(tiny_build.output, explicit_server.repository, url)
    triton = grpcclient.InferenceServerClient(url)
    responses: queue.Queue = queue.Queue()
    triton.start_stream(callback=lambda result, error: responses.put((result, error)))
    triton.async_stream_infer("tiny", make_inputs(grpcclient, "a long one", True, {"max_tokens": 100,
                                                                                   "min_tokens": 100}))
    result, error = responses.get(timeout=30)
    assert error is None and result.as_numpy("output_ids").size  # generating
    triton.stop_stream(cancel_requests=True)

    started = time.monotonic()
    triton.unload_model("tiny")
    while time.monotonic() - started < 15:
        states = {m.version: m.state for m in triton.get_model_repository_index().models if m.name == "tiny"}
        if set(states.values()) == {"UNAVAILABLE"}:  # every version (an earlier test's too)
            break
        time.sleep(0.1)
    assert set(states.values()) == {"UNAVAILABLE"} and time.monotonic() - started < 5, states


def test_deploy_refuses_what_it_cannot_do(tiny_build, tmp_path):
    with pytest.raises(DeployError, match="no such model repository"):
        deploy(tiny_build.output, tmp_path / "missing", "127.0.0.1:1")
    (tmp_path / "repo").mkdir()
    with pytest.raises(DeployError, match="no Triton server at 127.0.0.1:1"):
        deploy(tiny_build.output, tmp_path / "repo", "127.0.0.1:1")
    with pytest.raises(DeployError, match="expected one model named other"):
        deploy(tiny_build.output, tmp_path / "repo", "127.0.0.1:1", model="other")


def test_cli_deploy_names_the_problem_and_exits_with_the_serving_code(tiny_build, tmp_path):
    import subprocess
    import sys

    llmc = Path(sys.executable).parent / "llmc"
    run = subprocess.run([str(llmc), "deploy", str(tiny_build.output), "--repository", str(tmp_path / "nowhere"),
                          "--url", "127.0.0.1:1"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 8 and "no such model repository" in run.stdout + run.stderr
