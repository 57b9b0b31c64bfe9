"""A stage's code identity is derived from what it imports (compiler/code_closure.py), never listed by hand:
touching a module a stage imports changes that stage's key, and no unrelated stage's key."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from checkpoints import REPO
from llmc.compiler import code_closure, hashing
from llmc.compiler.pipeline.stages import STAGES

CACHED = {stage.name: stage for stage in STAGES if stage.artifact is not None}  # the stages with a cache key


@pytest.fixture
def probe(tmp_path, monkeypatch):
    """A package `probe` whose modules import each other in every way the walker follows, as the root."""
    files = {
        "__init__.py": "",
        "a.py": "def f():\n    from probe import b  # function-local, a submodule by name\n    return b\n",
        "b.py": "from .sub import c  # relative\n",
        "sub/__init__.py": "HEAVY = 1\n",
        "sub/c.py": 'RUNNER = "probe.d:Cls"  # a class a worker imports by name\n',
        "sub/kernels/k.c": "int k(void) { return 1; }\n",  # data beside c, in a folder that is no package
        "d.py": "class Cls:\n    pass\n",
        "e.py": "import probe.a\n",  # imports a; a does not import it
    }
    for name, text in files.items():
        (tmp_path / "probe" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "probe" / name).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(code_closure, "ROOT", "probe")
    code_closure.locate.cache_clear()
    yield tmp_path / "probe"
    code_closure.locate.cache_clear()


def test_the_closure_follows_local_relative_and_by_name_imports_and_the_data_beside_them(probe):
    assert code_closure.closure(["probe.a"]) == {"probe.a", "probe.b", "probe.sub.c", "probe.d"}
    labels = [label for label, _ in code_closure.code_files(["probe.a"])]
    assert "probe.sub/kernels/k.c" in labels and "probe.sub" not in labels  # a package's __init__ only when named
    before = hashing.code_hash("probe.a")
    (probe / "e.py").write_text("import probe.a\nX = 2\n")
    (probe / "sub" / "__init__.py").write_text("HEAVY = 2\n")
    (probe / "sub" / "kernels" / "__pycache__").mkdir()
    (probe / "sub" / "kernels" / "__pycache__" / "k.pyc").write_bytes(b"build output")
    assert hashing.code_hash("probe.a") == before  # what a does not import, and caches, are not its code
    for name, text in (("d.py", "class Cls:\n    x = 1\n"), ("sub/kernels/k.c", "int k(void) { return 2; }\n")):
        (probe / name).write_text(text)
        assert hashing.code_hash("probe.a") != before, name
        before = hashing.code_hash("probe.a")


def _touched_stages(monkeypatch, relative: str) -> set[str]:
    """The cached stages whose code hash changes when the file at `relative` (in the source tree) changes."""
    path = (REPO / relative).resolve()
    assert path.is_file(), relative
    before = {name: hashing.code_hash(*stage.code) for name, stage in CACHED.items()}
    real = hashing.sha256_file
    monkeypatch.setattr(hashing, "sha256_file", lambda p: "touched" if Path(p).resolve() == path else real(p))
    after = {name: hashing.code_hash(*stage.code) for name, stage in CACHED.items()}
    monkeypatch.setattr(hashing, "sha256_file", real)
    return {name for name in CACHED if before[name] != after[name]}


@pytest.mark.parametrize("relative, stages", [
    # what the hand-kept lists missed: verify's reference decode uses the LongRoPE tables (graph/greedy.py), as do
    # the quality report's and the engine check's, which decode through it; the family's config reader; the MoE
    # op's router and SwiGLU, which the expert quantizer runs (artifacts.py names the op's lowerings, so every
    # stage that records an artifact imports the op)
    ("runtime/engine/longrope.py", {"verify", "verify-adapters", "quantize", "draft", "tensorrt"}),
    ("compiler/models/config.py", {"environment", "export", "verify", "verify-adapters", "quantize", "draft",
                                   "tensorrt"}),
    ("plugins/op/moe.py", {"environment", "export", "verify", "verify-adapters", "quantize", "draft", "tensorrt"}),
    # and nothing beyond what imports a module
    ("compiler/quantize/awq.py", {"quantize", "draft"}),
    ("compiler/tensorrt/engine.py", {"tensorrt"}),
    ("runtime/kernels/paged_attention/paged_attention.c", {"environment", "verify", "verify-adapters", "quantize",
                                                           "draft", "tensorrt"}),
    # the adapters' check, and nothing else, imports PEFT's forward as hooks
    ("compiler/lora/peft_forward.py", {"verify-adapters"}),
    ("compiler/textdata/corpus.txt", {"export", "quantize", "draft", "tensorrt"}),
    ("runtime/serving/loop.py", set()),
    ("llmc/openai/app.py", set()),
])
def test_touching_a_module_changes_the_keys_of_the_stages_that_import_it_and_no_other(monkeypatch, relative, stages):
    assert _touched_stages(monkeypatch, relative) == stages


GRIMP_PROBE = """
import json, grimp
graph = grimp.build_graph("llmc")
print(json.dumps({m: sorted(i for i in graph.find_modules_directly_imported_by(m) if i.startswith("llmc"))
                  for m in graph.modules}))
"""


def test_every_import_grimp_finds_in_the_tree_the_closure_finds_too(tmp_path):
    """An independent reading of the same tree: import-linter's graph library, run on the tree laid out as
    installed (scripts/lint_imports.py's view). Each edge it finds between llmc modules is an edge here."""
    spec = importlib.util.spec_from_file_location("lint_imports", REPO / "scripts" / "lint_imports.py")
    lint_imports = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lint_imports)
    lint_imports.make_view(REPO, tmp_path / "view")
    res = subprocess.run([sys.executable, "-c", GRIMP_PROBE], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path / "view")
    assert res.returncode == 0, res.stderr
    graph = json.loads(res.stdout)
    assert len(graph) > 150
    missing = {m: sorted(set(edges) - code_closure.imports(m)) for m, edges in graph.items()}
    assert not {m: e for m, e in missing.items() if e}
