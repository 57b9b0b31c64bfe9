"""The import rules (pyproject.toml's [tool.importlinter] contracts), checked by import-linter through
scripts/lint_imports.py: kept by the tree, and broken, by name, when a forbidden import is added to a
copy of it (the tree itself is never touched)."""

import importlib.util
import shutil
import tomllib

import pytest

from checkpoints import REPO

ROOT = REPO
CONTRACTS = len(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"])
SOURCES = ("llmc", "compiler", "runtime", "plugins", "model_repository")  # pyproject's package-dir folders


def _lint_imports():
    spec = importlib.util.spec_from_file_location("lint_imports", ROOT / "scripts" / "lint_imports.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_tree_keeps_every_contract():
    result = _lint_imports().lint(ROOT, [])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout and "broken" not in result.stdout.replace("0 broken", "")
    assert f"Contracts: {CONTRACTS} kept" in result.stdout


@pytest.mark.parametrize("module, line, contract, chain", [
    ("runtime/decoding/sampling.py", "import llmc.compiler.spec", "runtime and model_repository never import the compiler",
     "llmc.runtime.decoding.sampling -> llmc.compiler.spec"),
    ("model_repository/model.py", "from llmc.compiler.spec import BuildSpec",
     "runtime and model_repository never import the compiler", "llmc.model_repository.model -> llmc.compiler.spec"),
    ("plugins/op/attention.py", "from llmc.runtime.layout import KVLayout",
     "plugins import neither the compiler nor the runtime", "llmc.plugins.op.attention -> llmc.runtime.layout"),
    ("runtime/decoding/tokenizer.py", "import transformers", "runtime and model_repository import no torch or transformers",
     "llmc.runtime.decoding.tokenizer -> transformers"),
    ("llmc/client/stream.py", "from llmc.runtime.serving.request import parse_request",
     "the client needs only tritonclient and numpy", "llmc.runtime.serving.request -> pydantic"),
    ("runtime/engine/sequence.py", "from llmc.runtime.serving.request import Request",
     "runtime wings: serving -> engine -> runners -> kernels | lora -> decoding",
     "llmc.runtime.engine.sequence -> llmc.runtime.serving.request"),
    ("runtime/decoding/sampling.py", "from llmc.runtime.engine.sequence import Sequence",
     "runtime wings: serving -> engine -> runners -> kernels | lora -> decoding",
     "llmc.runtime.decoding.sampling -> llmc.runtime.engine.sequence"),
    ("runtime/kernels/cpu_kernels.py", "from llmc.runtime.runners.protocol import Runner",
     "runtime wings: serving -> engine -> runners -> kernels | lora -> decoding",
     "llmc.runtime.kernels.cpu_kernels -> llmc.runtime.runners.protocol"),
    ("runtime/layout.py", "from llmc.runtime.decoding.sampling import SamplingParams",
     "the manifest and the KV layout import no runtime wing", "llmc.runtime.layout -> llmc.runtime.decoding.sampling"),
    ("compiler/graph/export.py", "from llmc.compiler.pipeline.stages import STAGES",
     "the compiler's modules and packages import each other without cycles", "- .graph -> .pipeline (1 import)"),
    ("compiler/graph/passes.py", "from llmc.compiler.graph.export import ONNX_NAME",
     "the compiler's modules and packages import each other without cycles", "- .passes -> .export (1 import)"),
    ("plugins/op/onnx_schema.py", "from llmc.plugins.op.lowering import Lowering",
     "the plugins' modules import each other without cycles", "- .onnx_schema -> .lowering (1 import)"),
    ("plugins/gpu/configs.py", "from llmc.plugins.op.onnx_schema import Heads",
     "plugins: trt over gpu and op, which import neither each other nor trt", "llmc.plugins.gpu.configs -> llmc.plugins.op.onnx_schema"),
    ("llmc/fleet/store.py", "from llmc.fleet.objectstore import open_store",
     "the operator tools' modules import each other without cycles", "- .store -> .objectstore (1 import)"),
])
def test_a_forbidden_import_breaks_its_contract(tmp_path, module, line, contract, chain):
    copy = tmp_path / "tree"
    for folder in SOURCES:
        shutil.copytree(ROOT / folder, copy / folder, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copyfile(ROOT / "pyproject.toml", copy / "pyproject.toml")
    source = copy / module
    source.write_text(source.read_text() + f"\n\ndef _forbidden():\n    {line}\n")  # even a lazy import counts
    result = _lint_imports().lint(copy, [])
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"{contract} BROKEN" in result.stdout and f"Contracts: {CONTRACTS - 1} kept, 1 broken" in result.stdout
    assert chain in result.stdout, result.stdout
    assert "_forbidden" not in (ROOT / module).read_text()


def test_every_package_folder_is_installed():
    """pyproject lists packages by hand (package-dir maps the folders into llmc.*): a folder left off the list
    works in the editable checkout and is missing from a wheel (llmc.compiler.models was, until a
    non-editable install on the GPU machine failed to import it)."""
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folder_of = {package: folder for package, folder in tool["package-dir"].items()}
    listed = set(tool["packages"])
    found = set()
    for package, folder in folder_of.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((package, *rel)))
    assert found - listed == set(), "package folders missing from pyproject's [tool.setuptools] packages"
    assert listed - found == set(), "listed packages with no folder"
