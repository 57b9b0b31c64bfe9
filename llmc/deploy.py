"""`llmc deploy`: a build's model into a (possibly shared) Triton model repository as a new version,
loaded through Triton's repository API, with rollback.

    <repository>/<name>/config.pbtxt      the build's (replaced atomically when it changed)
    <repository>/<name>/<N>/               the build's version folder, copied in as N = latest + 1:
                                           staged under a hidden name, then renamed (one atomic step)

Then `load` on the server (it must run with `--model-control-mode explicit`): Triton loads version N
while the previous version keeps serving, switches to N once it is ready and unloads the old one
(whose streams in flight finish first: model.py drains on unload). A load that fails or does not
become ready in time is rolled back: the version folder goes, the old config comes back, the
previous version is loaded again, and DeployError says what Triton reported. Older version folders
beyond `keep` are removed after a successful deploy. A lock file serializes deploys of one model.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from llmc.compiler.output import link_tree
from llmc.triton_server import find_repository

CONFIG = "config.pbtxt"


class DeployError(RuntimeError):
    """The build could not be deployed; what was serving before still serves."""


@dataclass(frozen=True)
class DeployResult:
    model: str
    version: int
    previous: int | None
    seconds: float


def versions(model_dir: Path) -> list[int]:
    """The numeric version folders of a model in a repository, ascending."""
    if not model_dir.is_dir():
        return []
    return sorted(int(d.name) for d in model_dir.iterdir() if d.is_dir() and d.name.isdigit())


def _built_model(build_dir: Path, model: str | None) -> Path:
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


@contextmanager
def _locked(model_dir: Path):
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(model_dir.parent / f".{model_dir.name}.deploy.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _wait_ready(client, name: str, version: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if client.is_model_ready(name, str(version)):
            return True
        time.sleep(0.2)
    return False


def deploy(build_dir: Path, repository: Path, url: str, *, model: str | None = None, keep: int = 2,
           timeout: float = 300.0) -> DeployResult:
    """Deploy the model of `build_dir` into `repository` and load it on the Triton server at `url`
    (gRPC address). Raises DeployError, after rolling back, when the new version does not load."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    start = time.monotonic()
    built = _built_model(Path(build_dir), model)
    name, repository = built.name, Path(repository)
    if not repository.is_dir():
        raise DeployError(f"{repository}: no such model repository (create it, and start Triton on it with "
                          "--model-control-mode explicit)")
    client = grpcclient.InferenceServerClient(url)
    try:
        client.is_server_live()
    except InferenceServerException as err:
        raise DeployError(f"no Triton server at {url} ({err.message()})") from None
    target = repository / name
    with _locked(target):
        existing = versions(target)
        previous = existing[-1] if existing else None
        new = (previous or 0) + 1
        old_config = (target / CONFIG).read_text() if (target / CONFIG).is_file() else None
        target.mkdir(exist_ok=True)
        staged = target / f".staging-{new}-{os.getpid()}"
        shutil.rmtree(staged, ignore_errors=True)
        link_tree(built / "1", staged)  # builds are published as new files, so a link stays what was deployed
        _write_atomic(target / CONFIG, (built / CONFIG).read_text())
        os.rename(staged, target / str(new))
        try:
            client.load_model(name)
            if not _wait_ready(client, name, new, timeout):
                raise DeployError(f"version {new} of {name} was not ready after {timeout:.0f} s")
        except (InferenceServerException, DeployError) as err:
            reason = err.message() if isinstance(err, InferenceServerException) else str(err)
            reason = reason.strip().splitlines()[0] if reason.strip() else "no reason given"  # the server log has the rest
            _roll_back(client, target, new, old_config, previous)
            kept = f"version {previous} keeps serving" if previous else f"{name} is not loaded"
            raise DeployError(f"{name} version {new} failed to load: {reason}; rolled back, {kept}") from None
        for old in versions(target)[:-keep]:
            shutil.rmtree(target / str(old), ignore_errors=True)
    return DeployResult(name, new, previous, time.monotonic() - start)


def _roll_back(client, target: Path, new: int, old_config: str | None, previous: int | None) -> None:
    from tritonclient.utils import InferenceServerException

    shutil.rmtree(target / str(new), ignore_errors=True)
    if old_config is None:
        shutil.rmtree(target, ignore_errors=True)
        try:
            client.unload_model(target.name)
        except InferenceServerException:
            pass
        return
    _write_atomic(target / CONFIG, old_config)
    if previous is not None:
        try:
            client.load_model(target.name)  # the previous version again (it may have been unloaded by the failure)
        except InferenceServerException:
            pass
