"""A Triton model repository in an S3 bucket (AWS, or any S3 endpoint such as MinIO or moto), via boto3.

Credentials come from boto3's usual chain (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY /
AWS_DEFAULT_REGION, ~/.aws, an instance role): the same the Triton replicas read. Every failure
becomes StoreError naming the repository URL and what to change (no credentials, endpoint
unreachable, no such bucket, access denied).

- **Uploads are checked.** Each file goes up with an SHA-256 checksum the server verifies, then every
  object of the version is compared with the local file's hash (a multipart object's checksum is
  the hash of its parts' hashes: computed here the same way, at the same part size). A failed or
  mismatched upload removes what it wrote under the version's prefix.
- **The deploy lock** is an object created with `If-None-Match: *`: S3 (and moto) refuse a second
  create while it exists. Whoever finds it taken polls until `wait`, then is refused with the
  holder's host, pid and age; a holder that died leaves it behind, and `break_lock` deletes it
  explicitly (never on a timer: a slow deploy is not a dead one).
"""

from __future__ import annotations

import base64
import hashlib
import json
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from llmc.fleet.store import CONFIG, LOCK_POLL, LockBusy, StoreError, describe_owner, lock_owner, parse_s3

PART_SIZE = 64 * 1024 * 1024  # multipart threshold and part size: the checksum check recomputes parts at it
UPLOAD_THREADS = 8
MARKER = ".llmc-repository"  # an object that makes an empty repository prefix exist for Triton


def _b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode()


def file_checksum(path: Path, part_size: int | None = None) -> str:
    """The ChecksumSHA256 S3 reports for `path` uploaded at `part_size`: the file's SHA-256, or for a
    multipart upload the SHA-256 of the parts' SHA-256 digests."""
    size, part_size = path.stat().st_size, part_size or PART_SIZE
    with open(path, "rb") as f:
        if size < part_size:
            return _b64(hashlib.file_digest(f, "sha256").digest())
        parts = [hashlib.sha256(block).digest() for block in iter(lambda: f.read(part_size), b"")]
    return _b64(hashlib.sha256(b"".join(parts)).digest())


class S3Store:
    def __init__(self, url: str):
        import boto3
        from botocore.config import Config

        self.url = self.triton_path = url
        self.where = parse_s3(url)
        config = Config(retries={"max_attempts": 2, "mode": "standard"}, connect_timeout=5, read_timeout=60)
        # a session of its own: boto3's default one caches the credentials it first found
        self.s3 = boto3.session.Session().client("s3", endpoint_url=self.where.endpoint, config=config)

    def _error(self, err: Exception, doing: str) -> StoreError:
        """A boto3/botocore failure as one message naming the URL and what to change."""
        from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError

        if isinstance(err, NoCredentialsError):
            why = "no AWS credentials (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or configure ~/.aws)"
        elif isinstance(err, EndpointConnectionError):
            why = f"cannot reach the endpoint {self.where.endpoint or 'of AWS S3'}"
        elif isinstance(err, ClientError):
            code = str(err.response.get("Error", {}).get("Code", ""))
            status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch") or status == 403:
                why = f"access denied to bucket {self.where.bucket} ({code}): check the credentials' permissions"
            elif code in ("NoSuchBucket", "404") and doing == "open the bucket":
                why = f"no such bucket {self.where.bucket}"
            else:
                why = f"{code}: {err.response.get('Error', {}).get('Message', err)}"
        else:
            why = f"{type(err).__name__}: {err}"
        return StoreError(f"{self.url}: cannot {doing}: {why}")

    def _do(self, doing: str, fn, *args, **kwargs):
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn(*args, **kwargs)
        except (BotoCoreError, ClientError) as err:
            raise self._error(err, doing) from None

    def check(self) -> None:
        self._do("open the bucket", self.s3.head_bucket, Bucket=self.where.bucket)

    def create(self) -> None:
        """Make the prefix a folder Triton accepts (it refuses to start on a prefix holding no object)."""
        if not self._keys():
            self._do("create the repository", self.s3.put_object, Bucket=self.where.bucket, Key=self.where.key(MARKER),
                     Body=b"a Triton model repository managed by llmc deploy\n")

    def _folders(self, *parts: str) -> list[str]:
        prefix = self.where.key(*parts)
        paginator = self.s3.get_paginator("list_objects_v2")
        pages = paginator.paginate(Bucket=self.where.bucket, Prefix=prefix + "/" if prefix else "", Delimiter="/")
        found = []
        for page in self._do("list the repository", list, pages):
            found += [p["Prefix"].rstrip("/").rsplit("/", 1)[-1] for p in page.get("CommonPrefixes", [])]
        return found

    def _keys(self, *parts: str) -> list[dict]:
        paginator = self.s3.get_paginator("list_objects_v2")
        prefix = self.where.key(*parts)
        pages = paginator.paginate(Bucket=self.where.bucket, Prefix=prefix + "/" if prefix else "")
        return [obj for page in self._do("list the repository", list, pages) for obj in page.get("Contents", [])]

    def models(self) -> list[str]:
        return sorted(m for m in self._folders() if self.read(m, CONFIG) is not None)

    def versions(self, model: str) -> list[int]:
        return sorted(int(name) for name in self._folders(model) if name.isdigit())

    def read(self, model: str, name: str) -> str | None:
        return self._get_text(self.where.key(model, name))

    def write(self, model: str, name: str, text: str) -> None:
        self._do(f"write {model}/{name}", self.s3.put_object, Bucket=self.where.bucket,
                 Key=self.where.key(model, name), Body=text.encode(), ChecksumAlgorithm="SHA256")

    def read_bytes(self, model: str, name: str) -> bytes | None:
        """A file beside the versions (an adapter: llmc/fleet/adapters.py), or None."""
        from botocore.exceptions import ClientError

        key = self.where.key(model, name)
        try:
            return self.s3.get_object(Bucket=self.where.bucket, Key=key)["Body"].read()
        except ClientError as err:
            if err.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise self._error(err, f"read {key}") from None

    def write_bytes(self, model: str, name: str, data: bytes) -> None:
        self._do(f"write {model}/{name}", self.s3.put_object, Bucket=self.where.bucket,
                 Key=self.where.key(model, name), Body=data, ChecksumAlgorithm="SHA256")

    def delete(self, model: str, name: str) -> None:
        self._remove([self.where.key(model, name)])

    def upload_version(self, model: str, version: int, source: Path) -> None:
        """Upload `source` as `<model>/<version>/`, then check every object against its file; on any
        failure remove what was written and raise StoreError."""
        files = {p.relative_to(source).as_posix(): p for p in sorted(Path(source).rglob("*")) if p.is_file()}
        try:
            with ThreadPoolExecutor(UPLOAD_THREADS) as pool:
                list(pool.map(lambda item: self._put(model, version, *item), files.items()))
            self._verify(model, version, files)
        except BaseException:
            self.remove_version(model, version)
            raise

    def _put(self, model: str, version: int, name: str, path: Path) -> None:
        from boto3.s3.transfer import TransferConfig

        config = TransferConfig(multipart_threshold=PART_SIZE, multipart_chunksize=PART_SIZE)
        key = self.where.key(model, str(version), name)
        self._do(f"upload {model}/{version}/{name}", self.s3.upload_file, str(path), self.where.bucket, key,
                 ExtraArgs={"ChecksumAlgorithm": "SHA256"}, Config=config)

    def _verify(self, model: str, version: int, files: dict[str, Path]) -> None:
        prefix = self.where.key(model, str(version)) + "/"
        stored = {obj["Key"][len(prefix):] for obj in self._keys(model, str(version))}
        if stored != set(files):
            raise StoreError(f"{self.url}: {model}/{version} holds {sorted(stored ^ set(files))[:5]} unlike the build")
        for name, path in files.items():
            head = self._do(f"check {model}/{version}/{name}", self.s3.head_object, Bucket=self.where.bucket,
                            Key=prefix + name, ChecksumMode="ENABLED")
            remote = str(head.get("ChecksumSHA256", "")).split("-")[0]  # AWS appends "-<parts>" to multipart ones
            if remote != file_checksum(path):
                raise StoreError(f"{self.url}: {model}/{version}/{name}: checksum {remote or 'missing'} after "
                                 f"upload, expected {file_checksum(path)}")

    def remove_version(self, model: str, version: int) -> None:
        self._remove([obj["Key"] for obj in self._keys(model, str(version))])

    def remove_model(self, model: str) -> None:
        self._remove([obj["Key"] for obj in self._keys(model)])

    def _remove(self, keys: list[str]) -> None:
        for start in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            batch = [{"Key": k} for k in keys[start:start + 1000]]
            self._do("remove objects", self.s3.delete_objects, Bucket=self.where.bucket,
                     Delete={"Objects": batch, "Quiet": True})

    @contextmanager
    def lock(self, model: str, wait: float, break_lock: bool = False) -> Iterator[str | None]:
        """Hold `.<model>.deploy.lock`; yields a description of the lock broken (break_lock), else None."""
        key = self.where.key(f".{model}.deploy.lock")
        broken = self._break(model, key) if break_lock else None
        owner = lock_owner()
        deadline = time.monotonic() + wait
        while not self._try_lock(key, owner):
            if time.monotonic() >= deadline:
                holder = self._holder(key)
                raise LockBusy(f"{self.url}: another deploy of {model} holds the lock {key} ({holder}); waited "
                               f"{wait:.0f} s. If that deploy is dead, run again with --break-lock")
            time.sleep(LOCK_POLL)
        try:
            yield broken
        finally:
            body = self._get_text(key)
            if body is not None and json.loads(body) == owner:  # never delete a lock someone else broke and took
                self._do("release the deploy lock", self.s3.delete_object, Bucket=self.where.bucket, Key=key)

    def _try_lock(self, key: str, owner: dict) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.s3.put_object(Bucket=self.where.bucket, Key=key, Body=json.dumps(owner).encode(), IfNoneMatch="*")
            return True
        except ClientError as err:
            if err.response.get("Error", {}).get("Code") in ("PreconditionFailed", "ConditionalRequestConflict"):
                return False
            raise self._error(err, "take the deploy lock") from None

    def _get_text(self, key: str) -> str | None:
        from botocore.exceptions import ClientError

        try:
            return self.s3.get_object(Bucket=self.where.bucket, Key=key)["Body"].read().decode()
        except ClientError as err:
            if err.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise self._error(err, f"read {key}") from None

    def _holder(self, key: str) -> str:
        body = self._get_text(key)
        if body is None:
            return "released since"
        try:
            return describe_owner(json.loads(body))
        except (ValueError, TypeError, AttributeError):
            return "holder unknown"

    def _break(self, model: str, key: str) -> str | None:
        holder = self._holder(key)
        if holder == "released since":
            return None
        self._do("break the deploy lock", self.s3.delete_object, Bucket=self.where.bucket, Key=key)
        return f"broke the deploy lock of {model} held by {holder}"
