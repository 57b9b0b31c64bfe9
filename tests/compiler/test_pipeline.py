"""Stage cache (hit and miss) and atomic output (failed, interrupted and killed builds)."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmc.compiler import build
from llmc.compiler.spec import load_spec, parse_spec
from llmc.errors import SpecError, UnsupportedError

from conftest import make_checkpoint, write_spec


def _statuses(result):
    return {s.name: s.status for s in result.stages}


def test_rebuild_with_nothing_changed_reuses_every_stage(tiny_llama, tmp_path):
    spec = parse_spec({"name": "t", "source": str(tiny_llama)})
    first = build(spec, output=tmp_path / "out")
    assert _statuses(first) == {"source": "ran", "export": "ran", "verify": "ran", "quantize": "skipped", "package": "ran"}
    second = build(spec, output=tmp_path / "out")
    assert _statuses(second) == {"source": "ran", "export": "cached", "verify": "cached", "quantize": "skipped", "package": "ran"}
    assert second.exported == first.exported and second.verify == first.verify
    record = json.loads((tmp_path / "out" / "build.json").read_text())
    assert [s["status"] for s in record["stages"]] == ["ran", "cached", "cached", "skipped", "ran"]  # packaging always runs (links, small files)


def test_changed_spec_section_reruns_only_what_depends_on_it(tiny_llama, tmp_path):
    build(parse_spec({"name": "t", "source": str(tiny_llama)}), output=tmp_path / "out")
    changed = parse_spec({"name": "t", "source": str(tiny_llama), "verify": {"decode_steps": 8}})
    result = build(changed, output=tmp_path / "out")
    assert _statuses(result) == {"source": "ran", "export": "cached", "verify": "ran", "quantize": "skipped", "package": "ran"}
    assert result.verify.cases[0].decode_steps == 8


def test_changed_checkpoint_reruns_export(tmp_path):
    ckpt = make_checkpoint("llama", tmp_path / "ckpt", seed=0)
    spec = parse_spec({"name": "t", "source": str(ckpt)})
    first = build(spec, output=tmp_path / "out")
    make_checkpoint("llama", ckpt, seed=1)  # new weights, same folder
    second = build(spec, output=tmp_path / "out")
    assert _statuses(second)["export"] == "ran" and _statuses(second)["verify"] == "ran"
    assert second.exported.source_hash != first.exported.source_hash


def test_tampered_artifact_is_not_reused(tiny_llama, tmp_path):
    spec = parse_spec({"name": "t", "source": str(tiny_llama)})
    build(spec, output=tmp_path / "out", until="export")
    model = tmp_path / "out" / "export" / "model.onnx"
    model.write_bytes(model.read_bytes() + b"\0")
    assert _statuses(build(spec, output=tmp_path / "out", until="export"))["export"] == "ran"


def test_preflight_refuses_what_this_version_cannot_build(tiny_llama, tmp_path):
    with pytest.raises(UnsupportedError, match="target: tensorrt"):
        build(parse_spec({"name": "t", "source": str(tiny_llama), "target": "tensorrt", "precision": "fp16"}),
              output=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_max_seq_len_above_the_model_limit(tiny_llama, tmp_path):
    with pytest.raises(SpecError, match=r"limits.max_seq_len \(4096\) exceeds the model's max_position_embeddings \(2048\)"):
        build(parse_spec({"name": "t", "source": str(tiny_llama), "limits": {"max_seq_len": 4096}}),
              output=tmp_path / "out", until="export")
    assert not (tmp_path / "out").exists() and not list(tmp_path.iterdir())


def _start_build(spec_path: Path, output: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "llmc.cli", "build", str(spec_path), "-o", str(output)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _wait_for_staging(tmp_path: Path, proc: subprocess.Popen) -> Path:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        # the export stage has started once its folder exists inside the staging folder
        found = list(tmp_path.glob(".out.staging-*/export"))
        if found:
            return found[0].parent
        assert proc.poll() is None, proc.stdout.read().decode()
        time.sleep(0.05)
    raise AssertionError("build never reached the export stage")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_build_killed_midway_leaves_previous_output_intact(tmp_path, sig):
    ckpt = make_checkpoint("llama", tmp_path / "ckpt", seed=0)
    spec_path = write_spec(tmp_path, {"name": "t", "source": str(ckpt)})
    out = tmp_path / "out"
    build(load_spec(spec_path), output=out)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}

    make_checkpoint("llama", ckpt, seed=1)  # so the next build has to export again
    proc = _start_build(spec_path, out)
    staging = _wait_for_staging(tmp_path, proc)
    proc.send_signal(sig)
    proc.wait(timeout=60)
    after = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after == before
    if sig == signal.SIGTERM:
        # exit 130 from the CLI's handler; rarely the interrupt lands where Python's own exit-by-SIGINT
        # path takes over (returncode -2) — under investigation, see the issue notes
        assert proc.returncode in (130, -signal.SIGINT)
        assert not staging.exists()  # an interrupted build cleans up after itself
    else:
        assert staging.exists()  # nothing can clean up after SIGKILL ...
        result = build(load_spec(spec_path), output=out)  # ... so the next build does
        assert not staging.exists() and _statuses(result)["export"] == "ran"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]


def test_kill_between_the_two_renames_is_repaired(tiny_llama, tmp_path):
    from llmc.compiler.output import recover

    out = tmp_path / "out"
    build(parse_spec({"name": "t", "source": str(tiny_llama)}), output=out, until="export")
    dead_pid = 2**22 + 12345  # above the default pid_max: no such process
    assert not Path(f"/proc/{dead_pid}").exists()
    out.rename(tmp_path / f".out.retired-{dead_pid}")
    recover(out)
    assert (out / "build.json").is_file()
    assert not list(tmp_path.glob(".out.*"))


def test_code_hash_follows_the_source_of_the_named_modules(tmp_path, monkeypatch):
    from llmc.compiler.hashing import code_hash

    (tmp_path / "llmc_probe_mod.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = code_hash("llmc_probe_mod", "llmc.compiler.export")
    assert code_hash("llmc.compiler.export", "llmc_probe_mod") == before  # order does not matter
    (tmp_path / "llmc_probe_mod.py").write_text("X = 2\n")
    assert code_hash("llmc_probe_mod", "llmc.compiler.export") != before


def test_the_result_points_at_the_published_output(tiny_llama, tmp_path):
    result = build(parse_spec({"name": "t", "source": str(tiny_llama)}), output=tmp_path / "out")
    assert result.artifacts["export"].folder == tmp_path / "out" / "export"
    assert (result.artifacts["export"].folder / result.exported.onnx).is_file()
    assert result.artifacts["package"].folder == result.repository
