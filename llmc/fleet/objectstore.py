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

from pathlib import Path

from llmc.fleet.localstore import LocalStore
from llmc.fleet.store import StoreError, is_remote


def open_store(location: str | Path):
    """The store for a repository location (a folder, or an s3:// URL)."""
    if is_remote(location):
        from llmc.fleet.s3store import S3Store

        return S3Store(str(location))
    text = str(location)
    if "://" in text:
        raise StoreError(f"{text}: unsupported repository URL (a folder, or s3://[http://host:port/]bucket/prefix)")
    return LocalStore(Path(text))
