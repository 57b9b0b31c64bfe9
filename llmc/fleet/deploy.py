"""`llmc deploy`: a build's model into a shared Triton model repository (a folder, or an S3 bucket:
llmc/fleet/objectstore.py) as version N+1, loaded on every replica in turn, with rollback.

    <repository>/<name>/config.pbtxt   the build's, naming the version Triton serves
                                       (version_policy: specific), written last
    <repository>/<name>/<N+1>/         the build's version folder, uploaded whole and checked first

1. Take the model's deploy lock (a flock, or an S3 object created with If-None-Match): concurrent
   deploys of one model wait, then are refused naming the holder; `break_lock` breaks a dead one.
2. Pin the served config to version N, so nothing that reads the repository (a replica starting
   up, another load) can see N+1 before it is whole; upload N+1 (checked: store's own rule).
3. Write the config naming N+1 (last), then load it on each `--url` replica, one at a time,
   through the repository API, checking readiness (llmc/fleet/rollout.py).
4. Any failure: the old config comes back, N+1 is removed, every replica asked to load goes back
   to N (or unloads a model that was new), and DeployError names the replica and Triton's reason.
5. Success: version folders beyond `keep` are removed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from llmc.fleet.localstore import LocalStore
from llmc.fleet.objectstore import open_store
from llmc.fleet.store import CONFIG, StoreError
from llmc.fleet.rollout import Replica, ReplicaFailed, roll_back, roll_out
from llmc.triton_server import find_repository


class DeployError(RuntimeError):
    """The build could not be deployed; what was serving before still serves."""


@dataclass(frozen=True)
class DeployResult:
    model: str
    version: int
    previous: int | None
    seconds: float
    replicas: tuple[str, ...] = ()
    broke_lock: str | None = None  # what --break-lock broke


def versions(model_dir: Path) -> list[int]:
    """The numeric version folders of a model in a local repository, ascending."""
    return LocalStore(Path(model_dir).parent).versions(Path(model_dir).name)


def built_model(build_dir: Path, model: str | None) -> Path:
    """The model folder (`<repository>/<name>`, holding version 1/) of a build."""
    source = find_repository(build_dir)
    models = sorted(d for d in source.iterdir() if (d / CONFIG).is_file())
    if model is not None:
        models = [d for d in models if d.name == model]
    if len(models) != 1:
        names = ", ".join(d.name for d in sorted(source.iterdir()) if (d / CONFIG).is_file())
        raise DeployError(f"{source}: expected one model{f' named {model}' if model else ''}, found: {names or 'none'}")
    built = models[0]
    if versions(built) != [1]:
        raise DeployError(f"{built}: a build holds exactly one version folder, 1/")
    return built


def pinned(config_text: str, version: int) -> str:
    """`config_text` serving exactly `version` (and its packed environment, when it has one)."""
    from llmc.compiler.repository.triton_config import EXECUTION_ENV, parse, render

    cfg = parse(config_text)
    cfg.version_policy.specific.ClearField("versions")
    cfg.version_policy.specific.versions.append(version)
    if EXECUTION_ENV in cfg.parameters:
        value = cfg.parameters[EXECUTION_ENV].string_value
        head, sep, tail = value.partition("$$TRITON_MODEL_DIRECTORY/")
        if sep:  # $$TRITON_MODEL_DIRECTORY/<version>/<archive>: the archive the served version carries
            cfg.parameters[EXECUTION_ENV].string_value = f"{head}{sep}{version}/{tail.split('/', 1)[-1]}"
    return render(cfg)


def _connect(urls: list[str]) -> list[Replica]:
    try:
        return [Replica.connect(url) for url in urls]
    except ReplicaFailed as err:
        raise DeployError(f"no Triton server at {err.url} ({err.reason})" if "no Triton server" in err.reason
                          else str(err)) from None


def deploy(build_dir: Path, repository: str | Path, url: str | list[str], *, model: str | None = None,
           keep: int = 2, timeout: float = 300.0, lock_wait: float = 60.0, break_lock: bool = False) -> DeployResult:
    """Deploy the model of `build_dir` into `repository` (folder or s3:// URL) and load it on the
    Triton replicas at `url` (one gRPC address or several; none: publish only, for replicas that
    start later). Raises DeployError after rolling back."""
    start = time.monotonic()
    urls = [url] if isinstance(url, str) else list(url)
    built = built_model(Path(build_dir), model)
    name = built.name
    try:
        store = open_store(repository)
        store.check()
    except StoreError as err:
        raise DeployError(str(err)) from None
    replicas = _connect(urls)
    try:
        with store.lock(name, lock_wait, break_lock) as broken:
            previous, new = _publish_and_load(store, built, replicas, timeout)
            for old in store.versions(name)[:-keep]:
                store.remove_version(name, old)
    except StoreError as err:
        raise DeployError(str(err)) from None
    finally:
        for replica in replicas:
            replica.close()
    return DeployResult(name, new, previous, time.monotonic() - start, tuple(urls), broken)


def _publish_and_load(store, built: Path, replicas: list[Replica], timeout: float) -> tuple[int | None, int]:
    name = built.name
    existing = store.versions(name)
    previous = existing[-1] if existing else None
    new = (previous or 0) + 1
    old_config = store.read(name, CONFIG)
    if old_config is not None and previous is not None:
        old_config = pinned(old_config, previous)
        store.write(name, CONFIG, old_config)  # what serves, pinned: N+1 stays invisible until the config names it
    store.upload_version(name, new, built / "1")
    touched: list[Replica] = []
    try:
        store.write(name, CONFIG, pinned((built / CONFIG).read_text(), new))
        touched = roll_out(replicas, name, new, timeout)
    except (ReplicaFailed, StoreError) as err:
        touched = getattr(err, "touched", touched)
        problems = _undo(store, name, new, old_config, previous, touched)
        kept = f"version {previous} keeps serving" if previous else f"{name} is not loaded"
        where = f" on {err.url}: {err.reason}" if isinstance(err, ReplicaFailed) else f": {err}"
        also = f" (rollback problems: {'; '.join(problems)})" if problems else ""
        raise DeployError(f"{name} version {new} failed to load{where}; rolled back "
                          f"{len(touched)} of {len(replicas)} replica(s), {kept}{also}") from None
    except BaseException:  # interrupted (Ctrl-C, SIGTERM): put the repository and replicas back, then leave
        _undo(store, name, new, old_config, previous, touched or replicas)
        raise
    return previous, new


def _undo(store, name: str, new: int, old_config: str | None, previous: int | None,
          touched: list[Replica]) -> list[str]:
    """Put the repository and the touched replicas back as they were; the problems met, as text."""
    if old_config is None or previous is None:
        store.remove_model(name)
        return roll_back(touched, name, keep_serving=False)
    store.write(name, CONFIG, old_config)
    store.remove_version(name, new)  # before the reloads: a replica copying the model need not fetch it
    return roll_back(touched, name, keep_serving=True)
