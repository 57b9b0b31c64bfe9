"""The object store's own refusals against a local S3 endpoint (moto in server mode on 127.0.0.1):
the deploy lock, a bad repository named by its URL with nothing left half-uploaded, a corrupted
upload removed, and multipart checksums. No Triton server is needed; test_scaleout.py deploys to
replicas."""

from __future__ import annotations

import pytest

from llmc.fleet.deploy import DeployError, deploy
from llmc.fleet.objectstore import open_store
from llmc.fleet.store import LockBusy
from llmc.triton_server import free_port
from s3_server import CREDENTIALS, MotoServer, bucket_server


@pytest.fixture(scope="module")
def s3():
    with bucket_server() as server:
        yield server


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
    import llmc.fleet.s3store as s3store

    real = s3store.file_checksum
    monkeypatch.setattr(s3store, "file_checksum", lambda p, *a: "bogus" if p.name == "model.py" else real(p, *a))
    with pytest.raises(DeployError, match=r"models/scratch: tiny/1/model.py: checksum .* after upload, expected bogus"):
        deploy(tiny_build.output, f"s3://{s3.endpoint}/models/scratch", [])
    assert s3.keys("models", "scratch/") == []  # nothing half-uploaded, and the lock released


def test_multipart_checksums_match_what_s3_stores(s3, tmp_path, monkeypatch):
    import os

    import llmc.fleet.s3store as s3store

    monkeypatch.setattr(s3store, "PART_SIZE", 5 * 1024 * 1024)  # S3's smallest part: 3 parts for 11 MiB
    (tmp_path / "v").mkdir()
    (tmp_path / "v" / "big.bin").write_bytes(os.urandom(11 * 1024 * 1024))
    store = open_store(f"s3://{s3.endpoint}/models/multipart")
    store.upload_version("m", 1, tmp_path / "v")  # checks every object's checksum after the upload
    assert s3.keys("models", "multipart/") == ["multipart/m/1/big.bin"]
