"""The package stage's Triton model repository: layout, config.pbtxt, manifest, self-contained runtime."""

import json
import subprocess
from pathlib import Path

import pytest

import llmc
from llmc.compiler.repository.package import copy_runtime, requirements
from llmc.compiler.repository.triton_config import parse
from llmc.runtime.manifest import ManifestError, RepositoryManifest
from llmc.runtime.serving.tensors import OUTPUTS, SCALARS, TEXTS
from serving_rig import SERVING_ENV


def test_repository_layout_and_manifest(tiny_build):
    model_dir = tiny_build.repository / "tiny"
    version = model_dir / "1"
    for name in ("model.py", "model.onnx", "tokenizer.json", "manifest.json", "llmc/__init__.py"):
        assert (version / name).is_file(), name
    assert [p.name for p in tiny_build.repository.iterdir()] == ["tiny"]  # nothing else for Triton to trip on
    manifest = RepositoryManifest.load(version)
    assert manifest == tiny_build.manifest
    assert manifest.limits.max_batch_size == 4 and manifest.limits.max_seq_len == 128
    assert manifest.kv_layout.in_place and manifest.model_file == "model.onnx" and manifest.end_ids == [2]
    export_onnx = tiny_build.output / "export" / "model.onnx"
    assert (version / "model.onnx").stat().st_ino == export_onnx.stat().st_ino  # hard link, not a copy
    assert (model_dir / "requirements.txt").read_text().split() == requirements()
    assert "numpy<2" in requirements()


def test_a_manifest_written_before_model_file_was_named_still_loads(tiny_build):
    """`engine` named the model file until the word was kept for runtime/engine: a repository built before reads
    the same (its own runtime copy reads its own manifest; `llmc inspect` and the fleet read any)."""
    data = json.loads((tiny_build.repository / "tiny" / "1" / "manifest.json").read_text())
    data["engine"] = data.pop("model_file")
    assert RepositoryManifest.model_validate(data) == tiny_build.manifest


def test_config_is_a_decoupled_python_model_with_the_llm_tensor_names(tiny_build):
    cfg = parse((tiny_build.repository / "tiny" / "config.pbtxt").read_text())
    assert cfg.name == "tiny" and cfg.backend == "python" and cfg.max_batch_size == 0
    assert cfg.model_transaction_policy.decoupled
    inputs = {i.name: i for i in cfg.input}
    assert set(inputs) == {"text_input", "stop_words", *SCALARS, *TEXTS}
    assert not inputs["text_input"].optional and all(inputs[n].optional for n in (*SCALARS, *TEXTS))
    assert list(inputs["stop_words"].dims) == [-1]
    assert all(inputs[n].data_type == inputs["text_input"].data_type and list(inputs[n].dims) == [1] for n in TEXTS)
    assert {o.name for o in cfg.output} == set(OUTPUTS)


def test_missing_or_foreign_manifest_is_a_clear_error(tmp_path):
    with pytest.raises(ManifestError, match="missing"):
        RepositoryManifest.load(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"name": "x"}))
    with pytest.raises(ManifestError, match="rebuild"):
        RepositoryManifest.load(tmp_path)


def test_the_runtime_package_is_copied_whole_without_caches(tmp_path):
    """Every module and C source of llmc.runtime, at any depth, and the CPU-kernel library built
    here; no __pycache__ (the source has one wherever Python wrote its bytecode) and nothing else."""
    from llmc import runtime
    from llmc.runtime.kernels import cpu_kernels

    source = Path(runtime.__file__).parent
    copy_runtime(tmp_path / "llmc")
    copy = tmp_path / "llmc" / "runtime"
    copied = {str(p.relative_to(copy)) for p in copy.rglob("*") if p.is_file()}
    sources = {str(p.relative_to(source)) for p in source.rglob("*")
               if p.suffix in (".py", ".c", ".h") and "__pycache__" not in p.parts}
    library = cpu_kernels.library()
    library = f"kernels/{library.name}" if library else None
    assert copied == sources | ({library} if library else set())
    assert {"__init__.py", "layout.py", "engine/slot_engine.py", "serving/tensors.py", "kernels/cpu_kernels.c",
            "kernels/matmul_nbits4/matmul_nbits4.h", "kernels/paged_attention/paged_attention.c"} <= copied
    assert (tmp_path / "llmc" / "__init__.py").read_bytes() == Path(llmc.__file__).read_bytes()


def test_the_version_folder_runs_in_the_serving_env_alone(tiny_build):
    """The serving Python has no llmc, torch or transformers: the copied runtime must be enough."""
    python = SERVING_ENV / "bin" / "python3"
    if not python.exists():
        pytest.skip(".venv-serving is missing: run scripts/setup.sh")
    version = tiny_build.repository / "tiny" / "1"
    modules = sorted(".".join(p.relative_to(version).with_suffix("").parts)
                     for p in (version / "llmc" / "runtime").rglob("*.py") if p.name != "__init__.py")
    assert "llmc.runtime.serving.loop" in modules and "llmc.runtime.runners.trt" in modules
    code = f"""
import sys, threading
sys.path.insert(0, {str(version)!r})
import numpy as np, llmc
assert llmc.__file__.startswith({str(version)!r}), llmc.__file__
{"; ".join(f"import {m}" for m in modules)}
from llmc.runtime.serving.loop import ServingLoop
assert not {{"torch", "transformers", "onnx"}} & set(sys.modules), sorted(sys.modules)
done, out = threading.Event(), []
class Sink:
    def send(self, outputs, final):
        out.append(outputs)
        done.set() if final else None
    def error(self, message): raise SystemExit(message)
    def is_cancelled(self): return False
    def finish(self): raise SystemExit("finished a request nobody cancelled")
loop = ServingLoop.from_manifest({str(version)!r}).start()
loop.submit({{"text_input": np.array([b"hello"], dtype=object), "max_tokens": np.array([4], dtype=np.int32)}}, Sink())
assert done.wait(30)
loop.stop()
print(np.__version__, out[-1]["finish_reason"][0].decode(), len(out[-1]["output_ids"]))
"""
    res = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=120, cwd=version)
    assert res.returncode == 0, res.stderr
    numpy_version, reason, n = res.stdout.split()
    assert numpy_version.startswith("1.") and reason in ("length", "stop") and 1 <= int(n) <= 4
