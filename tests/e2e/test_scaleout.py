"""Scale-out, all real processes on 127.0.0.1: a local S3 endpoint (moto_server), two Triton
replicas serving one s3:// repository, `llmc deploy` rolling versions out across them under
streaming load, rolling every replica back when one fails, serializing concurrent deploys, and
putting everything back when interrupted. The store's own refusals (a bad repository, a corrupted
upload, the lock) are in test_s3store.py.

The replicas are shared by the module's tests, in order; the last one kills a replica."""

from __future__ import annotations

import shutil
import threading
import time
import urllib.request

import pytest

from serving_rig import BackgroundLoad, serving_env
from llmc.client import Client
from llmc.fleet.deploy import DeployError, deploy
from llmc.fleet.objectstore import open_store
from llmc.fleet.store import CONFIG
from llmc.triton_server import TritonServer, assemble, free_port
from s3_server import CREDENTIALS, bucket_server

pytestmark = pytest.mark.triton
# Traffic kept in flight through a deploy: two streaming clients a replica, half a second between a client's
# requests. With 0.1 s (four clients saturating the 2 cores) each replica's load took 17 s instead of 6 and the
# deploy 40 s; with 0.5 s it takes 20 s and each replica still completes ~80 requests during it.
DEPLOY_LOAD = {"workers": 2, "max_tokens": 16, "pause": 0.5}


@pytest.fixture(scope="module")
def s3():
    with bucket_server() as server:
        yield server


@pytest.fixture(scope="module")
def cluster(s3, tmp_path_factory):
    """Two Triton replicas on s3://http://127.0.0.1:PORT/models/repo, explicit model control (each
    load copies the model from the bucket: ~2-3 s on 2 cores, so two replicas, not three)."""
    env, root = serving_env(), tmp_path_factory.mktemp("cluster")
    url = f"s3://{s3.endpoint}/models/repo"
    open_store(url).create()
    server_dir = assemble(root / "server")
    servers = []
    try:
        for i in range(2):
            servers.append(TritonServer(url, server_dir=server_dir, serving_env=env, log_path=root / f"replica{i}.log",
                                        extra_args=("--model-control-mode", "explicit")).start())
        yield url, servers
    finally:
        for server in servers:
            server.stop()


def _triton(server):
    import tritonclient.grpc as grpcclient

    return grpcclient.InferenceServerClient(server.grpc_url)


def _served_versions(servers) -> list[list[str]]:
    ready = []
    for server in servers:
        index = _triton(server).get_model_repository_index().models
        ready.append(sorted(m.version for m in index if m.name == "tiny" and m.state == "READY"))
    return ready


def _pinned_version(url: str) -> int:
    from llmc.compiler.repository.triton_config import parse

    return list(parse(open_store(url).read("tiny", CONFIG)).version_policy.specific.versions)[0]


def _serving(tiny_build, url: str, servers, *, latest: bool = True) -> list[int]:
    """Every replica serves the version the bucket's config names, or with `latest=False` some version
    (for tests that need a served model, not a particular one); deployed here when the bucket is empty,
    so a test also runs alone. The bucket's versions. A replica already serving what is asked is left
    alone: a load copies the model from the bucket (seconds on 2 cores), even when nothing changed."""
    if not open_store(url).versions("tiny"):
        deploy(tiny_build.output, url, [s.grpc_url for s in servers])
    pinned = str(_pinned_version(url))
    for server in servers:
        served = _served_versions([server])[0]
        if not (served == [pinned] if latest else served):
            _triton(server).load_model("tiny")
    return open_store(url).versions("tiny")


def test_deploy_v2_under_streaming_load_on_every_replica(tiny_build, cluster):
    url, servers = cluster
    urls = [s.grpc_url for s in servers]
    first = deploy(tiny_build.output, url, urls)
    assert (first.version, first.previous, first.replicas) == (1, None, tuple(urls))
    assert _served_versions(servers) == [["1"]] * 2

    loads = [BackgroundLoad(u, **DEPLOY_LOAD) for u in urls]
    for load in loads:
        load.__enter__()
    try:
        time.sleep(1.0)
        second = deploy(tiny_build.output, url, urls)
        after = time.monotonic()
        deadline = after + 30
        while not all(sum(t > after for t in load.ok) >= 3 for load in loads) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        for load in loads:
            load.__exit__(None, None, None)
    assert (second.version, second.previous) == (2, 1)
    assert [load.errors for load in loads] == [[], []]
    assert all(sum(t > after for t in load.ok) >= 3 for load in loads)
    assert _served_versions(servers) == [["2"]] * 2 and _pinned_version(url) == 2
    for server in servers:  # the traffic after the deploy ran on version 2 on every replica
        stats = _triton(server).get_inference_statistics("tiny", "2").model_stats[0]
        assert stats.inference_stats.success.count >= 3


def test_a_load_failing_on_one_replica_rolls_every_replica_back(tiny_build, cluster, tmp_path):
    url, servers = cluster
    before = _serving(tiny_build, url, servers)
    previous, new = before[-1], before[-1] + 1
    broken = tmp_path / "broken"
    shutil.copytree(tiny_build.output, broken)
    model_py = broken / "model_repository" / "tiny" / "1" / "model.py"
    model_py.write_text(  # fails only in the second replica's stubs (their parent is that server)
        f"import os\nif os.getppid() == {servers[1].process.pid}:\n"
        "    raise RuntimeError('injected load failure on this replica')\n" + model_py.read_text())
    with BackgroundLoad([s.grpc_url for s in servers], **DEPLOY_LOAD) as load:
        with pytest.raises(DeployError) as failed:
            deploy(broken, url, [s.grpc_url for s in servers], timeout=60)
        after = time.monotonic()
        deadline = after + 30
        while sum(t > after for t in load.ok) < 4 and time.monotonic() < deadline:
            time.sleep(0.1)
    assert load.errors == [] and sum(t > after for t in load.ok) >= 4  # serving went on through the rollback
    message = str(failed.value)
    assert f"tiny version {new} failed to load on {servers[1].grpc_url}: " in message
    assert "injected load failure" in message
    assert f"rolled back 2 of 2 replica(s), version {previous} keeps serving" in message
    assert _served_versions(servers) == [[str(previous)]] * 2 and _pinned_version(url) == previous
    assert open_store(url).versions("tiny") == before
    for server in servers:
        assert len(Client(server.grpc_url, "tiny").complete("still serving", max_tokens=4).output_ids) == 4


def test_an_interrupted_deploy_puts_the_repository_and_every_replica_back(tiny_build, cluster, monkeypatch):
    """Ctrl-C while the second replica loads the new version (the first has loaded it): the
    interrupt propagates; the config names the old version again, the new one is gone from the
    bucket, the first replica serves the old version again and the lock is released."""
    import llmc.fleet.rollout as rollout

    url, servers = cluster
    before = _serving(tiny_build, url, servers)
    real = rollout.Replica.load
    loaded = []

    def load(self, model, version, timeout):
        if self.url == servers[1].grpc_url:
            raise KeyboardInterrupt
        real(self, model, version, timeout)
        loaded.append((self.url, version))

    monkeypatch.setattr(rollout.Replica, "load", load)
    with pytest.raises(KeyboardInterrupt):
        deploy(tiny_build.output, url, [s.grpc_url for s in servers], timeout=60)
    assert loaded == [(servers[0].grpc_url, before[-1] + 1)]  # the interrupt came after one replica moved
    assert _served_versions(servers) == [[str(before[-1])]] * 2 and _pinned_version(url) == before[-1]
    assert open_store(url).versions("tiny") == before
    with open_store(url).lock("tiny", wait=0):  # released: a lock left behind would raise LockBusy
        pass


def test_two_deploys_at_once_run_one_after_the_other(tiny_build, cluster):
    """Publish-only deploys (no replica to load: the lock guards the repository, and a load per
    replica costs seconds): the second waits for the first, so neither sees the other's half."""
    url, servers = cluster
    base = _serving(tiny_build, url, servers)[-1]
    results, errors = [], []

    def one():
        try:
            results.append(deploy(tiny_build.output, url, [], lock_wait=60))
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
    # serialized: neither saw the other's half
    assert sorted((r.previous, r.version) for r in results) == [(base, base + 1), (base + 1, base + 2)]
    assert open_store(url).versions("tiny") == [base + 1, base + 2] and _pinned_version(url) == base + 2
    assert _served_versions(servers) == [[str(base)]] * 2  # published only: the replicas load it when told


def test_requests_fail_over_to_a_live_replica_before_their_first_token(cluster):
    import asyncio

    from llmc.client import AsyncClient

    _, servers = cluster
    dead = f"127.0.0.1:{free_port()}"  # nothing listens: connection refused
    client = Client([dead, servers[0].grpc_url], "tiny")
    for i in range(4):  # each replica takes a turn at going first
        assert len(client.complete(f"failover {i}", max_tokens=4).output_ids) == 4

    async def run():
        async with AsyncClient([dead, servers[0].grpc_url], "tiny") as aclient:
            return [len((await aclient.complete(f"async failover {i}", max_tokens=4)).output_ids) for i in range(4)]

    assert asyncio.run(run()) == [4, 4, 4, 4]
    with pytest.raises(Exception, match=rf"{dead}: .*UNAVAILABLE|{dead}: .*connect"):
        Client([dead], "tiny").complete("nowhere", max_tokens=4)


def test_llmc_serve_serves_the_bucket(tiny_build, cluster, s3):
    from llmc.errors import ServingError
    from llmc.serve import start_server

    url, servers = cluster
    _serving(tiny_build, url, servers, latest=False)
    server = start_server(url, None, None, None, serving_env())
    try:
        assert _served_versions([server]) == [[str(_pinned_version(url))]]  # the version the config names
        assert len(Client(server.grpc_url).complete("from the bucket", max_tokens=4).output_ids) == 4
    finally:
        server.stop()
    with pytest.raises(ServingError, match=r"models/empty: no model there yet; publish one with llmc deploy"):
        start_server(f"s3://{s3.endpoint}/models/empty", None, None, None, serving_env())


def test_the_autoscaler_metrics_are_exported_by_a_live_replica(tiny_build, cluster):
    from llmc.fleet.k8s import K8sOptions, manifests

    url, servers = cluster
    _serving(tiny_build, url, servers, latest=False)
    opts = K8sOptions(packed_python="3.12", name="tiny", repository=url)
    hpa = manifests(opts)["hpa.yaml"][0]
    with urllib.request.urlopen(f"http://127.0.0.1:{servers[0].ports.metrics}/metrics", timeout=10) as r:
        samples = {line.split("{")[0].split(" ")[0] for line in r.read().decode().splitlines()
                   if line and not line.startswith("#")}
    names = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]]
    assert names and set(names) <= samples, sorted(s for s in samples if s.startswith("llmc_"))


def test_a_replica_killed_under_load(tiny_build, cluster):
    """Runs last: it kills a replica. New requests go to the others; the streams it held end with
    an error naming it; no client hangs (BackgroundLoad checks every thread returned)."""
    import os
    import signal

    url, servers = cluster
    _serving(tiny_build, url, servers, latest=False)
    victim = servers[1]
    with BackgroundLoad([s.grpc_url for s in servers], workers=4, max_tokens=24, timeout=60) as load:
        time.sleep(1.5)
        os.killpg(victim.process.pid, signal.SIGKILL)  # the server and its model stubs
        victim.process.wait()
        killed = time.monotonic()
        deadline = killed + 30
        while sum(t > killed for t in load.ok) < 12 and time.monotonic() < deadline:
            time.sleep(0.1)
    served = sum(t > killed for t in load.ok)
    assert served >= 12, (served, load.errors)
    assert len(load.errors) <= 4, load.errors  # at most the streams in flight on the victim (4 workers)
    assert all(victim.grpc_url in e for e in load.errors), load.errors


def test_cli_names_the_bucket_and_exits_with_the_serving_code(tiny_build):
    import os
    import subprocess
    import sys
    from pathlib import Path

    llmc = Path(sys.executable).parent / "llmc"
    nowhere = f"s3://http://127.0.0.1:{free_port()}/models/repo"
    run = subprocess.run([str(llmc), "deploy", str(tiny_build.output), "--repository", nowhere, "--url", "127.0.0.1:1"],
                         capture_output=True, text=True, timeout=120, env={**os.environ, **CREDENTIALS})
    assert run.returncode == 8 and "cannot reach the endpoint" in run.stdout + run.stderr
    assert nowhere in (run.stdout + run.stderr).replace("\n", "")
    run = subprocess.run([str(llmc), "serve"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 7 and "pass a BUILD_DIR, or --repository s3://" in run.stdout + run.stderr
