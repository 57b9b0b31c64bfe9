"""A model repository in a local folder (objectstore.py says what a store offers): a version is staged under a
hidden name and renamed, one atomic step."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from llmc.fleet.store import CONFIG, LOCK_POLL, LockBusy, StoreError, lock_owner, owner_text


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
        data = self.read_bytes(model, name)
        return data.decode() if data is not None else None

    def write(self, model: str, name: str, text: str) -> None:
        self.write_bytes(model, name, text.encode())

    def read_bytes(self, model: str, name: str) -> bytes | None:
        """A file beside the versions (an adapter: llmc/fleet/adapters.py), or None."""
        path = self.root / model / name
        return path.read_bytes() if path.is_file() else None

    def write_bytes(self, model: str, name: str, data: bytes) -> None:
        path = self.root / model / name
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_bytes(data)
        os.replace(tmp, path)

    def delete(self, model: str, name: str) -> None:
        (self.root / model / name).unlink(missing_ok=True)

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
                        holder = owner_text(f.read())
                        raise LockBusy(f"{self.url}: another deploy of {model} holds {path.name} ({holder}); "
                                       f"waited {wait:.0f} s") from None
                    time.sleep(LOCK_POLL)
            f.seek(0)
            f.truncate()
            f.write(json.dumps(lock_owner()))
            f.flush()
            yield None
