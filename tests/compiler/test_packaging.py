"""A built wheel carries the package-dir mapping (compiler/ -> llmc.compiler, ...) and runs."""

import subprocess
import sys
import zipfile
from checkpoints import REPO


def test_wheel_imports_and_runs(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(REPO)], check=True, timeout=300)
    wheel = next((tmp_path / "dist").glob("llmc-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for module in ("llmc/cli/__init__.py", "llmc/cli/app.py", "llmc/compiler/spec/__init__.py",
                   "llmc/compiler/graph/export.py", "llmc/compiler/pipeline/stages.py",
                   "llmc/compiler/repository/package.py", "llmc/compiler/textdata/corpus.txt", "llmc/runtime/layout.py", "llmc/plugins/__init__.py", "llmc/model_repository/model.py",
                   "llmc/runtime/serving/loop.py"):
        assert module in names
    assert not any(n.startswith(("compiler/", "runtime/", "plugins/", "tests/")) for n in names)
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, timeout=300)
    code = ("import llmc.compiler.spec as s, llmc.cli; assert s.__file__.startswith(%r), s.__file__; "
            "print(s.parse_spec({'name': 'm', 'source': 'x'}).target.value)") % str(target)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "onnxruntime"


def test_serving_side_imports_no_torch():
    code = ("import sys, llmc.runtime.runners.ort, llmc.runtime.layout, llmc.runtime.engine.slot_engine, llmc.compiler.spec, "
            "llmc.cli; "
            "bad = {'torch', 'transformers'} & set(sys.modules); assert not bad, bad")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
