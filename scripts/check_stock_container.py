"""Serve a build's packed environment (execution_env) from a separate root filesystem, the way a stock
Triton container runs it: its own system Python at /usr/bin/pythonX.Y with no packages, a Python-backend
stub linked against that Python, and nothing else installed.

No container runtime or NGC image is reachable here, so the "container" is a Debian root made with
debootstrap (Debian's packages) holding only python3.X and libpython3.X; Triton is the nvidia-pytriton
wheel's tritonserver copied into it. The stub for that Python is taken from the wheel, and where the
wheel bundles its own libpython the stub is relinked (patchelf) to the root's, as NVIDIA's stub links the
container's system Python. Needs root (chroot, debootstrap) and Debian's debootstrap and patchelf:

    apt-get install debootstrap patchelf
    llmc build model.yaml          # with  execution_env: {python: "3.11"}  (bookworm's Python)
    sudo .venv/bin/python scripts/check_stock_container.py build/tiny --suite bookworm --python 3.11

It prints how long the archive took to unpack and the model to load, and the text of a request sent
from outside the root. Everything it starts is stopped by its PID; the root is kept for the next run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

PORTS = {"http": 18000, "grpc": 18001, "metrics": 18002}


def make_root(root: Path, suite: str, python: str) -> None:
    if (root / "usr" / "bin" / f"python{python}").exists():
        return
    subprocess.run(["debootstrap", "--variant=minbase", f"--include=python{python},libpython{python}", suite, str(root),
                    "http://deb.debian.org/debian"], check=True)


def install_server(root: Path, python: str) -> None:
    """tritonserver, its libraries and the stub for `python`, linked against the root's libpython."""
    from llmc.triton_server import _pytriton_root, assemble

    server = root / "opt" / "tritonserver"
    shutil.rmtree(server, ignore_errors=True)
    assemble(server, python)
    libs = root / "opt" / "nvidia_pytriton.libs"
    if not libs.is_dir():
        shutil.copytree(_pytriton_root().parent / "nvidia_pytriton.libs", libs)
    stub = server / "backends" / "python" / "triton_python_backend_stub"
    needed = subprocess.run(["patchelf", "--print-needed", str(stub)], check=True, capture_output=True,
                            text=True).stdout.split()
    system = f"libpython{python}.so.1.0"
    for lib in needed:
        if lib.startswith("libpython") and lib != system:  # the wheel's own build of Python: use the root's
            subprocess.run(["patchelf", "--replace-needed", lib, system, str(stub)], check=True)


def serve(root: Path, build: Path, model: str, prompt: str) -> None:
    from llmc.client import Client

    repo = root / "models"
    shutil.rmtree(repo, ignore_errors=True)
    shutil.copytree(build / "model_repository", repo)
    log = open(root / "tritonserver.log", "wb")
    cmd = ["chroot", str(root), "/usr/bin/env", "-i", "PATH=/usr/bin:/bin", "LD_LIBRARY_PATH=/opt/nvidia_pytriton.libs",
           "/opt/tritonserver/bin/tritonserver", "--model-repository=/models",
           "--backend-directory=/opt/tritonserver/backends", "--http-address=127.0.0.1", "--grpc-address=127.0.0.1",
           "--metrics-address=127.0.0.1", *(f"--{name}-port={port}" for name, port in PORTS.items()),
           "--allow-gpu-metrics=false"]
    proc = root / "proc"  # a container has /proc (ONNX Runtime reads the CPU's features there)
    mounted = not os.path.ismount(proc)
    if mounted:
        subprocess.run(["mount", "-t", "proc", "proc", str(proc)], check=True)
    start = time.monotonic()
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while process.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{PORTS['http']}/v2/health/ready", timeout=1):
                    break
            except OSError:
                time.sleep(0.2)
        else:
            sys.exit(f"tritonserver exited with {process.returncode}; see {root / 'tritonserver.log'}")
        print(f"ready in {time.monotonic() - start:.1f} s (the archive unpacked, the model loaded)")
        result = Client(f"127.0.0.1:{PORTS['grpc']}", model).complete(prompt, max_tokens=12)
        print(f"{len(result.output_ids)} tokens: {result.text!r}")
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=60)
        log.close()
        if mounted:
            subprocess.run(["umount", str(proc)], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("build", type=Path, help="a build folder whose spec has an execution_env for --python")
    parser.add_argument("--root", type=Path, default=Path("/tmp/llmc-stock-root"))
    parser.add_argument("--suite", default="bookworm", help="the Debian release of the root")
    parser.add_argument("--python", default="3.11", help="its Python (bookworm: 3.11, trixie: 3.13)")
    parser.add_argument("--prompt", default="The capital of France is")
    args = parser.parse_args()
    from llmc.runtime.manifest import RepositoryManifest

    models = sorted(d for d in (args.build / "model_repository").iterdir() if (d / "config.pbtxt").is_file())
    manifest = RepositoryManifest.load(models[0] / "1")
    env = manifest.execution_env
    if env is None or env.python != args.python:
        sys.exit(f"{models[0]}: build it with execution_env.python {args.python!r} (it has "
                 f"{env.python if env else 'no execution_env'})")
    make_root(args.root, args.suite, args.python)
    install_server(args.root, args.python)
    print(f"{manifest.name}: {(models[0] / '1' / env.archive).stat().st_size / 2**20:.0f} MiB archive for "
          f"{env.interpreter} in a {args.suite} root with no packages")
    serve(args.root, args.build, manifest.name, args.prompt)


if __name__ == "__main__":
    main()
