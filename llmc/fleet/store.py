"""What both repository stores share (objectstore.py opens one): the errors, Triton's S3 URL, the lock's owner.

`open_store(location)` (objectstore.py) returns a LocalStore (localstore.py) or an S3Store (s3store.py); both
import only this module, so neither store imports the other or the dispatcher.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

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


def owner_text(text: str) -> str:
    try:
        return describe_owner(json.loads(text))
    except (ValueError, TypeError, AttributeError):
        return "holder unknown"


