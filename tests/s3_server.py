"""A local S3 endpoint for tests: moto in server mode on 127.0.0.1, a free port, started and stopped
by the test that needs it (real HTTP, so Triton's S3 client and boto3 both talk to it)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import urllib.request

from llmc.triton_server import free_port

# `python -m moto.server ARGS`, minus one waste: to route a request, moto lists its own package folder (~180 stat
# calls) every time, and the answer never changes while it runs. Cached, a request costs ~40% less CPU, and requests
# are most of a model load from the bucket: Triton's S3 client sends 1,100-1,700 (lists, HEADs and GETs over every
# file of every version) each time a replica loads or reloads a model. A moto without that function runs as it is.
SERVE = """
import functools, sys
import moto.backends, moto.server
listing = getattr(moto.backends, "list_of_moto_modules", None)
if listing is not None:
    moto.backends.list_of_moto_modules = functools.cache(lambda: tuple(listing()))
moto.server.main(sys.argv[1:])
"""
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


class MotoServer:
    """`with MotoServer() as s3:` -> s3.endpoint ("http://127.0.0.1:PORT"); `auth_after=n` turns on
    moto's IAM checks after n unauthenticated calls (the setup), so keys without a policy are refused."""

    def __init__(self, auth_after: int | None = None):
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.auth_after = auth_after
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> "MotoServer":
        env = dict(os.environ)
        if self.auth_after is not None:
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = str(self.auth_after)
        self.process = subprocess.Popen([sys.executable, "-c", SERVE, "-H", "127.0.0.1", "-p", str(self.port)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=1).close()
                return self
            except OSError:
                time.sleep(0.05)
        self.__exit__()
        raise RuntimeError(f"moto_server did not start on {self.endpoint}")

    def client(self, service: str = "s3", **credentials):
        import boto3

        keys = credentials or {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}
        return boto3.client(service, endpoint_url=self.endpoint, region_name="us-east-1", **keys)

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return [obj["Key"] for page in pages for obj in page.get("Contents", [])]

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)


@contextlib.contextmanager
def bucket_server():
    """A MotoServer with the bucket `models`, and CREDENTIALS in the environment (what boto3 and the
    Triton replicas started under it read) while it runs."""
    saved = {key: os.environ.get(key) for key in CREDENTIALS}
    os.environ.update(CREDENTIALS)
    try:
        with MotoServer() as server:
            server.client().create_bucket(Bucket="models")
            yield server
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
