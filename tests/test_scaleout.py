"""Scale-out, all real processes on 127.0.0.1: a local S3 endpoint (moto_server), two Triton
replicas serving one s3:// repository, `llmc deploy` rolling versions out across them under
streaming load, rolling every replica back when one fails, serializing concurrent deploys, and
refusing a bad repository with one clear message and nothing left half-uploaded.

The replicas are shared by the module's tests, in order; the last one kills a replica."""

from __future__ import annotations

import shutil
import threading
import time
import urllib.request

import pytest

from conftest import BackgroundLoad, serving_env
from llmc.client import Client
from llmc.deploy import DeployError, deploy
from llmc.objectstore import CONFIG, LockBusy, open_store
from llmc.triton_server import TritonServer, assemble, free_port
from s3_server import CREDENTIALS, MotoServer

pytestmark = pytest.mark.triton


@pytest.fixture(scope="module")
def s3():
    with pytest.MonkeyPatch.context() as mp:
        for key, value in CREDENTIALS.items():  # what boto3 here and the Triton replicas read
            mp.setenv(key, value)
        with MotoServer() as server:
            server.client().create_bucket(Bucket="models")
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
    from llmc.compiler.triton_config import parse

    return list(parse(open_store(url).read("tiny", CONFIG)).version_policy.specific.versions)[0]


def _serving(tiny_build, url: str, servers) -> list[int]:
    """Every replica serves the version the bucket's config names (deployed here when the bucket is
    empty, so a test also runs alone); the bucket's versions."""
    if not open_store(url).versions("tiny"):
        deploy(tiny_build.output, url, [s.grpc_url for s in servers])
    for server in servers:
        _triton(server).load_model("tiny")
    return open_store(url).versions("tiny")


def test_deploy_v2_under_streaming_load_on_every_replica(tiny_build, cluster):
    url, servers = cluster
    urls = [s.grpc_url for s in servers]
    first = deploy(tiny_build.output, url, urls)
    assert (first.version, first.previous, first.replicas) == (1, None, tuple(urls))
    assert _served_versions(servers) == [["1"]] * 2

    loads = [BackgroundLoad(u, workers=2, max_tokens=16) for u in urls]
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
    with BackgroundLoad([s.grpc_url for s in servers], workers=2, max_tokens=16) as load:
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


def test_the_deploy_lock_refuses_then_breaks_explicitly(s3):
    store = open_store(f"s3://{s3.endpoint}/models/locks")
    with store.lock("m", wait=0):
        with pytest.raises(LockBusy, match=r"another deploy of m holds the lock .*pid \d+, \d+ s ago.*--break-lock"):
            with store.lock("m", wait=0.5):
                pass
    assert s3.keys("models", "locks/") == []  # released
    s3.client().put_object(Bucket="models", Key="locks/.m.deploy.lock",  # left by a deploy that died
                           Body=b'{"host": "gone", "pid": 4242, "since": 0}')
    with pytest.raises(LockBusy, match="gone pid 4242"):
        with store.lock("m", wait=0):
            pass
    with store.lock("m", wait=0, break_lock=True) as broken:
        assert broken.startswith("broke the deploy lock of m held by gone pid 4242")
    assert s3.keys("models", "locks/") == []


def test_bad_repositories_name_the_url_and_leave_nothing(tiny_build, s3, monkeypatch, tmp_path):
    nowhere = f"s3://http://127.0.0.1:{free_port()}/models/repo"
    with pytest.raises(DeployError, match=rf"^{nowhere}: cannot open the bucket: cannot reach the endpoint"):
        deploy(tiny_build.output, nowhere, [])
    with pytest.raises(DeployError, match="no such bucket missing-bucket"):
        deploy(tiny_build.output, f"s3://{s3.endpoint}/missing-bucket/repo", [])

    for key in CREDENTIALS:
        monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(DeployError, match=rf"{s3.endpoint}/models/repo: cannot open the bucket: no AWS credentials"):
        deploy(tiny_build.output, f"s3://{s3.endpoint}/models/repo", [])

    with MotoServer(auth_after=6) as locked:  # IAM checked after the setup: a user without any policy
        admin = {"aws_access_key_id": "a", "aws_secret_access_key": "b"}
        locked.client(**admin).create_bucket(Bucket="private")
        iam = locked.client("iam", **admin)
        iam.create_user(UserName="nobody")
        key = iam.create_access_key(UserName="nobody")["AccessKey"]
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])
        monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        with pytest.raises(DeployError, match=r"private/repo: cannot .*access denied to bucket private"):
            deploy(tiny_build.output, f"s3://{locked.endpoint}/private/repo", [])


def test_a_corrupted_upload_is_removed(tiny_build, s3, monkeypatch):
    import llmc.s3store as s3store

    real = s3store.file_checksum
    monkeypatch.setattr(s3store, "file_checksum", lambda p, *a: "bogus" if p.name == "model.py" else real(p, *a))
    with pytest.raises(DeployError, match=r"models/scratch: tiny/1/model.py: checksum .* after upload, expected bogus"):
        deploy(tiny_build.output, f"s3://{s3.endpoint}/models/scratch", [])
    assert s3.keys("models", "scratch/") == []  # nothing half-uploaded, and the lock released


def test_multipart_checksums_match_what_s3_stores(s3, tmp_path, monkeypatch):
    import os

    import llmc.s3store as s3store

    monkeypatch.setattr(s3store, "PART_SIZE", 5 * 1024 * 1024)  # S3's smallest part: 3 parts for 11 MiB
    (tmp_path / "v").mkdir()
    (tmp_path / "v" / "big.bin").write_bytes(os.urandom(11 * 1024 * 1024))
    store = open_store(f"s3://{s3.endpoint}/models/multipart")
    store.upload_version("m", 1, tmp_path / "v")  # checks every object's checksum after the upload
    assert s3.keys("models", "multipart/") == ["multipart/m/1/big.bin"]


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
    _serving(tiny_build, url, servers)
    server = start_server(url, None, None, None, serving_env())
    try:
        assert _served_versions([server]) == [[str(_pinned_version(url))]]  # the version the config names
        assert len(Client(server.grpc_url).complete("from the bucket", max_tokens=4).output_ids) == 4
    finally:
        server.stop()
    with pytest.raises(ServingError, match=r"models/empty: no model there yet; publish one with llmc deploy"):
        start_server(f"s3://{s3.endpoint}/models/empty", None, None, None, serving_env())


def test_the_autoscaler_metrics_are_exported_by_a_live_replica(tiny_build, cluster):
    from llmc.k8s import K8sOptions, manifests

    url, servers = cluster
    _serving(tiny_build, url, servers)
    opts = K8sOptions(name="tiny", repository=url)
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
    _serving(tiny_build, url, servers)
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
