"""Where a Triton model repository lives: a local folder or an S3 bucket (llmc/fleet/s3store.py).

`open_store(location)` takes what Triton's `--model-repository` takes: a folder, or
`s3://[http[s]://host:port/]bucket/prefix` (a bare `host:port` means http, as Triton reads it;
no endpoint means AWS). Both stores offer what `llmc deploy` needs, the same way:

    versions(model)                 the numeric version folders, ascending
    read(model, name) / write(...)  a small file beside the versions (config.pbtxt)
    upload_version(model, n, src)   version n, whole and checked, or nothing (staged, then visible)
    remove_version / remove_model   undo an upload, prune
    lock(model, wait, break_lock)   serialize deploys of one model

A local version folder is staged under a hidden name and renamed (one atomic step); an S3 prefix
cannot be renamed, so there the served config.pbtxt is the pointer: it names the version Triton
loads (`version_policy: specific`, see llmc/fleet/deploy.py), and a version uploaded under a prefix no
config names is invisible until the config, written last, names it.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

CONFIG = "config.pbtxt"
LOCK_POLL = 0.25  # seconds between attempts to take a busy lock


class StoreError(RuntimeError):
    """The repository cannot be reached, read or written; the message names its URL."""


class LockBusy(StoreError):
    """Another deploy of the model holds the lock (and kept it past the wait)."""


@dataclass(frozen=True)
class S3Location:
    bucket: str
    prefix: str  # no leading or trailing slash; "" for the bucket's root
    endpoint: str | None  # http(s)://host:port, or None for AWS

    def key(self, *parts: str) -> str:
        return "/".join(p.strip("/") for p in (self.prefix, *parts) if p)


def parse_s3(url: str) -> S3Location:
    """Triton's S3 repository URL: s3://[http[s]://host:port/]bucket/prefix. Raises StoreError."""
    assert url.startswith("s3://"), url
    rest, scheme = url[len("s3://"):], None
    for candidate in ("http", "https"):
        if rest.startswith(candidate + "://"):
            scheme, rest = candidate, rest[len(candidate) + 3:]
    first, _, path = rest.partition("/")
    if scheme or ":" in first:
        endpoint, (bucket, _, prefix) = f"{scheme or 'http'}://{first}", path.partition("/")
    else:
        endpoint, bucket, prefix = None, first, path
    if not bucket:
        raise StoreError(f"{url}: no bucket in the URL (s3://[http://host:port/]bucket/prefix)")
    return S3Location(bucket, prefix.strip("/"), endpoint)


def is_remote(location: str | Path) -> bool:
    return str(location).startswith("s3://")


def lock_owner() -> dict:
    """Who holds a lock: written into it, shown to whoever finds it taken."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}


def describe_owner(owner: dict) -> str:
    age = time.time() - float(owner.get("since", time.time()))
    return f"{owner.get('host', '?')} pid {owner.get('pid', '?')}, {age:.0f} s ago"


class LocalStore:
    """A model repository in a local folder (what a local Triton or a shared volume serves)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.url = str(self.root)
        self.triton_path = str(self.root.resolve())

    def check(self) -> None:
        if not self.root.is_dir():
            raise StoreError(f"{self.root}: no such model repository (create it, and start Triton on it with "
                             "--model-control-mode explicit)")

    def create(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    def models(self) -> list[str]:
        return sorted(d.name for d in self.root.iterdir() if (d / CONFIG).is_file())

    def versions(self, model: str) -> list[int]:
        folder = self.root / model
        if not folder.is_dir():
            return []
        return sorted(int(d.name) for d in folder.iterdir() if d.is_dir() and d.name.isdigit())

    def read(self, model: str, name: str) -> str | None:
        path = self.root / model / name
        return path.read_text() if path.is_file() else None

    def write(self, model: str, name: str, text: str) -> None:
        path = self.root / model / name
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(text)
        os.replace(tmp, path)

    def upload_version(self, model: str, version: int, source: Path) -> None:
        from llmc.compiler.output import link_tree

        staged = self.root / model / f".staging-{version}-{os.getpid()}"
        shutil.rmtree(staged, ignore_errors=True)
        staged.parent.mkdir(parents=True, exist_ok=True)
        try:
            link_tree(source, staged)  # builds are published as new files, so a link stays what was deployed
            os.rename(staged, self.root / model / str(version))
        finally:
            shutil.rmtree(staged, ignore_errors=True)

    def remove_version(self, model: str, version: int) -> None:
        shutil.rmtree(self.root / model / str(version), ignore_errors=True)

    def remove_model(self, model: str) -> None:
        shutil.rmtree(self.root / model, ignore_errors=True)

    @contextmanager
    def lock(self, model: str, wait: float, break_lock: bool = False) -> Iterator[str | None]:
        """flock on `.<model>.deploy.lock`: the kernel releases it when its holder dies, so a local
        lock is never stale (`break_lock` has nothing to break). Yields None."""
        path = self.root / f".{model}.deploy.lock"
        with open(path, "a+") as f:
            deadline = time.monotonic() + wait
            while True:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        f.seek(0)
                        holder = _owner_text(f.read())
                        raise LockBusy(f"{self.url}: another deploy of {model} holds {path.name} ({holder}); "
                                       f"waited {wait:.0f} s") from None
                    time.sleep(LOCK_POLL)
            f.seek(0)
            f.truncate()
            f.write(json.dumps(lock_owner()))
            f.flush()
            yield None


def _owner_text(text: str) -> str:
    try:
        return describe_owner(json.loads(text))
    except (ValueError, TypeError, AttributeError):
        return "holder unknown"


def open_store(location: str | Path):
    """The store for a repository location (a folder, or an s3:// URL)."""
    if is_remote(location):
        from llmc.fleet.s3store import S3Store

        return S3Store(str(location))
    text = str(location)
    if "://" in text:
        raise StoreError(f"{text}: unsupported repository URL (a folder, or s3://[http://host:port/]bucket/prefix)")
    return LocalStore(Path(text))
