"""The serving rig of the tests: Triton servers on the serving environment, their shared memory, a load in the
background, the PyTorch greedy reference, and a recording sink for the serving loop."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest

from checkpoints import REPO, byte_tokenizer

def greedy_reference(model, prompt_ids: list[int], max_tokens: int, end_ids=()) -> list[int]:
    """PyTorch greedy tokens for one prompt, ending after an end id as the runtime does."""
    from llmc.compiler.graph.greedy import torch_greedy

    _, last = torch_greedy(model, prompt_ids, max_tokens, lambda: None)
    tokens = [int(l.argmax()) for l in last]
    for i, t in enumerate(tokens):
        if t in end_ids:
            return tokens[:i + 1]
    return tokens


SERVING_ENV = REPO / ".venv-serving"


def stub_shm_regions(pid: int) -> set[str]:
    """The /dev/shm regions of the Python-backend stubs below process `pid` (a Triton server, or what started
    one): each stub is handed its region's name on its command line. A server's own regions, not those of
    servers other tests run at the same time (scripts/test.sh runs two workers)."""
    from llmc.supervisor import children

    names, parents = set(), [pid]
    while parents:
        for child in children(parents.pop()):
            parents.append(child)
            try:
                args = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            names |= {a.decode() for a in args if a.startswith(b"triton_python_backend_shm_region")}
    return names


def shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def serving_env() -> Path:
    """The numpy<2 venv the Python backend runs in (scripts/setup.sh makes it); skips without it."""
    if not (SERVING_ENV / "bin" / "python3").exists():
        pytest.skip(".venv-serving is missing: run scripts/setup.sh")
    return SERVING_ENV


def complete_on_triton(repository: Path, tmp_path: Path, prompts: list[str], max_tokens: int, model: str = "tiny"):
    """Each prompt's output ids from a real Triton server on `repository` (greedy, one at a time),
    and llmc's metrics of `model` after them."""
    from llmc.client import Client
    from llmc.soak import llmc_metrics
    from llmc.triton_server import TritonServer, assemble

    with TritonServer(repository, server_dir=assemble(tmp_path / "server"), serving_env=serving_env(),
                      log_path=tmp_path / "server.log") as server:
        client = Client(server.grpc_url, model)
        got = [client.complete(prompt, max_tokens=max_tokens).output_ids for prompt in prompts]
        return got, llmc_metrics(f"http://127.0.0.1:{server.ports.metrics}", model)


class BackgroundLoad:
    """Threads streaming greedy requests of exactly `max_tokens` tokens until stopped: the times of
    the requests that completed whole, and the errors of the others. Leaving the block stops them
    and checks that every thread returned (nothing hangs). `pause`: seconds a thread waits between
    its requests, so a load meant to be in flight during something else (a deploy, a model load on
    the same 2 cores) does not starve it."""

    def __init__(self, url: str, model: str = "tiny", *, workers: int = 3, max_tokens: int = 24,
                 timeout: float | None = None, pause: float = 0.0):
        import threading

        self.url, self.model, self.max_tokens, self.timeout, self.pause = url, model, max_tokens, timeout, pause
        self.ok: list[float] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._work, args=(i,), daemon=True) for i in range(workers)]

    def _work(self, worker: int) -> None:
        import time

        from llmc.client import Client, Generation, GenerationError

        client = Client(self.url, self.model, timeout=self.timeout)
        while not self._stop.is_set():
            gen = Generation()
            try:
                for _ in client.generate(f"request {worker} {len(self.ok)}", True, gen, max_tokens=self.max_tokens,
                                         min_tokens=self.max_tokens):
                    pass
                if len(gen.output_ids) != self.max_tokens:
                    raise GenerationError(f"{len(gen.output_ids)} tokens, not {self.max_tokens}")
                self.ok.append(time.monotonic())
                self._stop.wait(self.pause)
            except GenerationError as err:
                self.errors.append(str(err))
                time.sleep(0.05)

    def served_after(self, moment: float) -> bool:
        return any(t > moment for t in self.ok)

    def __enter__(self) -> "BackgroundLoad":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)
        assert not any(t.is_alive() for t in self._threads), "a client thread hangs"


def assert_serves_like_its_graph(result, tmp_path: Path, prompt: str = "quantized hello", tokens: int = 12) -> None:
    """Serve a build's repository through Triton: greedy output equals the built graph's own greedy
    decode (the quantized graph when there is one) run in process."""
    from llmc.client import Client
    from llmc.compiler.quantize.quality import greedy
    from llmc.runtime.runners.paged_slots import slot_runner
    from llmc.triton_server import TritonServer, assemble

    env = serving_env()
    engine = result.quantized or result.exported
    folder = "quantize" if result.quantized else "export"
    runner = slot_runner(result.output / folder / engine.onnx, engine.kv_layout, max_batch=1, capacity=64)
    expected = greedy(runner, [byte_tokenizer().encode(prompt).ids], tokens)[0]
    with TritonServer(result.repository, server_dir=assemble(tmp_path / "server"), serving_env=env,
                      log_path=tmp_path / "server.log") as server:
        gen = Client(server.grpc_url).complete(prompt, max_tokens=tokens, min_tokens=tokens)
    assert gen.output_ids == expected


def add_model_variant(repository: Path, source: str, name: str, **limits) -> None:
    """Copy model `source` of a Triton repository as model `name`, with some serving limits changed."""
    import shutil

    from llmc.compiler.repository.triton_config import parse, render
    from llmc.runtime.manifest import RepositoryManifest

    shutil.copytree(repository / source, repository / name)
    cfg = parse((repository / name / "config.pbtxt").read_text())
    cfg.name = name
    (repository / name / "config.pbtxt").write_text(render(cfg))
    manifest = RepositoryManifest.load(repository / name / "1")
    manifest.model_copy(update={"name": name, "limits": manifest.limits.model_copy(update=limits)}).save(
        repository / name / "1")


class RecordingSink:
    def __init__(self, cancel_after: int | None = None):
        self.responses, self.errors, self.done = [], [], threading.Event()
        self.finished = 0  # final flags sent alone (a cancelled request's end)
        self.cancel_after = cancel_after

    def send(self, outputs, final):
        self.responses.append(outputs)
        if final:
            self.done.set()

    def error(self, message):
        self.errors.append(message)
        self.done.set()

    def is_cancelled(self):
        return self.cancel_after is not None and len(self.responses) >= self.cancel_after

    def finish(self):
        self.finished += 1
        self.done.set()

    def wait(self, timeout=30):
        assert self.done.wait(timeout), "no final response"
        return self

    def joined(self, name):
        """One output tensor over every response (waits for the final one; no errors)."""
        self.wait()
        assert not self.errors, self.errors
        return np.concatenate([r[name] for r in self.responses])

    @property
    def text(self):
        return "".join(r["text_output"][0].decode() for r in self.responses)

    @property
    def ids(self):
        return [int(i) for r in self.responses for i in r["output_ids"]]

    @property
    def finish_reason(self):
        return self.responses[-1]["finish_reason"][0].decode() if self.responses else None


def request_inputs(prompt="hello there", **kw):
    """A request's input tensors as Triton hands them to the model: the prompt, then named scalars."""
    inputs = {"text_input": np.array([prompt.encode()], dtype=object)}
    for name, value in kw.items():
        if isinstance(value, str):  # a text input (BYTES [1]): the guide's type and text
            inputs[name] = np.array([value.encode()], dtype=object)
            continue
        dtype = {bool: np.bool_, float: np.float32, int: np.int32}[type(value)]
        inputs[name] = np.array([value], dtype=dtype)
    return inputs
