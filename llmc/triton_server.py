"""A real NVIDIA Triton Inference Server, assembled from the `nvidia-pytriton` wheel and run locally.

The wheel ships `tritonserver` (CPU build, Python backend included) and Python-backend stubs per
Python version. `assemble()` copies the server and the stub for this Python into one folder;
`TritonServer` starts it on 127.0.0.1 with the given (or free) ports, waits until it is ready and
stops it (SIGTERM, then SIGKILL after a grace period), as a context manager.

The Python backend stub embeds the `python3` found first on PATH, so that interpreter's
environment is what `model.py` imports from; it must have numpy < 2 (the stub is built against
numpy 1's ABI: with numpy 2 it misreads every output tensor). `serving_env` names that
environment (a venv's folder); scripts/setup.sh creates one in `.venv-serving`.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sysconfig
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path


EXIT_TIMEOUT = 10  # seconds Triton waits for in-flight requests and open connections when stopping


class TritonError(RuntimeError):
    """The server could not be assembled, started or reached."""


def _pytriton_root() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise TritonError("the nvidia-pytriton wheel is not installed (scripts/setup.sh installs it)")
    return Path(list(spec.submodule_search_locations)[0])


def assemble(dest: Path, python_version: str | None = None) -> Path:
    """Copy tritonserver and the Python-backend stub for `python_version` into `dest` (once)."""
    version = python_version or sysconfig.get_python_version()
    server = dest / "bin" / "tritonserver"
    stub = dest / "backends" / "python" / "triton_python_backend_stub"
    if server.is_file() and stub.is_file():
        return dest
    source = _pytriton_root() / "tritonserver"
    stub_source = source / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub_source.is_file():
        raise TritonError(f"nvidia-pytriton has no Python-backend stub for Python {version}")
    tmp = dest.with_name(dest.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp, ignore=shutil.ignore_patterns("python_backend_stubs", "__pycache__"))
    shutil.copy2(stub_source, tmp / "backends" / "python" / "triton_python_backend_stub")
    if not (server.is_file() and stub.is_file()):  # not finished meanwhile by another process (the shared cache)
        shutil.rmtree(dest, ignore_errors=True)
    try:
        tmp.rename(dest)
    except OSError:  # another process put a whole one there first: it may be serving from it already
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def find_repository(path: Path) -> Path:
    """The model repository in a build folder (`<build>/model_repository`), or `path` itself if it is one."""
    path = Path(path)
    for candidate in (path / "model_repository", path):
        if candidate.is_dir() and any((d / "config.pbtxt").is_file() for d in candidate.iterdir() if d.is_dir()):
            return candidate
    if not path.exists():
        raise TritonError(f"{path}: no such folder (pass a build folder made by `llmc build`)")
    raise TritonError(f"{path}: no model repository there (a build folder holds model_repository/<name>/config.pbtxt; "
                      "builds of checkpoints without a tokenizer have none)")


def find_serving_env(explicit: Path | None = None) -> Path:
    """The serving Python: `explicit`, else $LLMC_SERVING_ENV, else the .venv-serving scripts/setup.sh made."""
    import llmc

    source_root = Path(llmc.__file__).resolve().parents[1]
    candidates = [explicit] if explicit else [Path(p) for p in [os.environ.get("LLMC_SERVING_ENV")] if p] or [
        Path.cwd() / ".venv-serving", source_root / ".venv-serving"]
    for env in candidates:
        if (env / "bin" / "python3").exists():
            return env.absolute()
    raise TritonError(f"no serving environment at {', '.join(map(str, candidates))}: run scripts/setup.sh, or pass "
                      "a venv with the repository's requirements.txt installed (--serving-env / LLMC_SERVING_ENV)")


def cache_dir() -> Path:
    """Where the assembled server lives between runs ($XDG_CACHE_HOME/llmc)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmc"


def default_server_dir() -> Path:
    """The assembled server for this nvidia-pytriton and Python version, under `cache_dir()`."""
    import importlib.metadata

    try:
        version = importlib.metadata.version("nvidia-pytriton")
    except importlib.metadata.PackageNotFoundError:
        raise TritonError("the nvidia-pytriton wheel is not installed (scripts/setup.sh installs it)") from None
    return cache_dir() / f"tritonserver-{version}-py{sysconfig.get_python_version()}"


def check_port_free(port: int, flag: str) -> None:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            raise TritonError(f"port {port} on 127.0.0.1 is in use; pick another with {flag}") from None


def free_ports(count: int, avoid=()) -> list[int]:
    """`count` distinct free ports on 127.0.0.1, none of them in `avoid`. Their sockets are held open together while
    they are drawn: drawn one at a time (each socket closed before the next bind), the OS may hand the same port
    out twice, and a server given it for HTTP and for metrics refused to start ("cannot listen to HTTP requests
    and metrics requests at the same address and port")."""
    held, ports = [], []
    try:
        while len(ports) < count:
            s = socket.socket()
            held.append(s)
            s.bind(("127.0.0.1", 0))
            if s.getsockname()[1] not in avoid:
                ports.append(s.getsockname()[1])
    finally:
        for s in held:
            s.close()
    return ports


def free_port() -> int:
    return free_ports(1)[0]


@dataclass(frozen=True)
class Ports:
    http: int
    grpc: int
    metrics: int

    @classmethod
    def free(cls, http: int | None = None, grpc: int | None = None, metrics: int | None = None) -> "Ports":
        """The ports given, and distinct free ones for those not given (free_ports)."""
        given = [p for p in (http, grpc, metrics) if p]
        drawn = iter(free_ports(3 - len(given), avoid=given))
        return cls(*(p or next(drawn) for p in (http, grpc, metrics)))


# llmc writes every config.pbtxt whole (compiler/repository/triton_config.py), so Triton's auto-completion adds
# nothing: the served config is the same with or without it. With it, each model load first starts a Python stub
# only to ask model.py for a completion: measured with the tiny test model, a load took 2.2 s, and 0.5 s without.
NO_AUTO_COMPLETE = "--disable-auto-complete-config"


class TritonServer:
    def __init__(self, repository: Path | str, *, server_dir: Path, serving_env: Path, ports: Ports | None = None,
                 log_path: Path | None = None, extra_args: tuple[str, ...] = ()):
        # a folder, or an s3:// URL Triton reads itself (kept as text: Path would fold its "//")
        self.repository = repository if str(repository).startswith("s3://") else Path(repository)
        self.server_dir, self.serving_env = Path(server_dir), Path(serving_env)
        self.ports = ports or Ports.free()
        self.log_path = log_path or self.server_dir / "tritonserver.log"
        self.extra_args = extra_args
        self.process: subprocess.Popen | None = None

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.ports.http}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.ports.grpc}"

    def _env(self) -> dict[str, str]:
        libs = [str(_pytriton_root().parent / "nvidia_pytriton.libs"), sysconfig.get_config_var("LIBDIR")]
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        env["LD_LIBRARY_PATH"] = os.pathsep.join(libs + [env.get("LD_LIBRARY_PATH", "")]).rstrip(os.pathsep)
        env["PATH"] = os.pathsep.join([str(self.serving_env / "bin"), env.get("PATH", "")])
        # serving reads the repository, never writes it: no __pycache__ beside model.py in a build
        # (`llmc deploy` would upload it, and each replica's load would fetch it again)
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        return env

    def start(self, timeout: float = 60.0) -> "TritonServer":
        if not (self.serving_env / "bin" / "python3").exists():
            raise TritonError(f"{self.serving_env}: no serving environment there (scripts/setup.sh creates .venv-serving)")
        cmd = [str(self.server_dir / "bin" / "tritonserver"), "--model-repository", str(self.repository),
               "--backend-directory", str(self.server_dir / "backends"),
               "--http-address", "127.0.0.1", "--grpc-address", "127.0.0.1", "--metrics-address", "127.0.0.1",
               "--http-port", str(self.ports.http), "--grpc-port", str(self.ports.grpc),
               "--metrics-port", str(self.ports.metrics), "--allow-metrics", "true", "--allow-gpu-metrics", "false",
               "--exit-timeout-secs", str(EXIT_TIMEOUT), NO_AUTO_COMPLETE, *self.extra_args]
        self._reap()  # a crashed server's model stubs, before its successor starts
        log = open(self.log_path, "ab")
        try:
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self._env(),
                                            start_new_session=True)
        finally:
            log.close()
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise TritonError(f"tritonserver exited with {self.process.returncode}; see {self.log_path}")
            try:
                with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise TritonError(f"tritonserver was not ready after {timeout:.0f} s; see {self.log_path}")

    def stop(self, grace: float = EXIT_TIMEOUT + 20.0) -> None:
        """SIGTERM the server (it drains for up to EXIT_TIMEOUT, unloads models, stops their stubs and
        removes their shared memory); SIGKILL its process group only if it hangs past `grace`."""
        if self.process is None or self.process.poll() is not None:
            self._reap()
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)  # the group we started: server and its stubs
            self.process.wait()

    def _reap(self) -> None:
        """Kill what is left of an exited server's process group: a server that crashed (or was killed)
        leaves its Python-backend stubs running, and nothing else would stop them."""
        if self.process is not None and self.process.poll() is not None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):  # the group is gone: nothing was left
                pass

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
