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

from checkpoints import make_checkpoint, write_spec


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


def test_the_result_points_at_the_published_output(tiny_llama, tmp_path):
    result = build(parse_spec({"name": "t", "source": str(tiny_llama)}), output=tmp_path / "out")
    assert result.artifacts["export"].folder == tmp_path / "out" / "export"
    assert (result.artifacts["export"].folder / result.exported.onnx).is_file()
    assert result.artifacts["package"].folder == result.repository


KEY_PROBE = """
import json, sys
from pathlib import Path
from llmc.compiler.hashing import code_hash
from llmc.compiler.pipeline.run import cache_key
from llmc.compiler.pipeline.stages import STAGES
from llmc.compiler.spec import parse_spec
from llmc.compiler.stage import Context

stages = {s.name: s for s in STAGES}
spec = parse_spec({"name": "t", "source": "x"})
ctx = Context(out=Path("out"), previous=Path("previous"), source=None, source_hash="", inputs_hash="",
              model=lambda: None)
keys = {}
for path in [None, *sys.argv[1:]]:  # each file in turn with one byte changed, then restored
    data = Path(path).read_bytes() if path else b""
    if path:
        Path(path).write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    keys[path or "unchanged"] = {"verify": cache_key(stages["verify"], spec, ctx),
                                 "quantize code": code_hash(*stages["quantize"].code)}
    if path:
        Path(path).write_bytes(data)
print(json.dumps(keys))
"""


def test_one_changed_byte_in_a_kernel_source_or_a_runner_changes_the_keys_of_what_runs_it(tmp_path):
    """The verify stage and the quantize stage's quality check run the runners (the paged ones too), and
    through them the CPU kernels, C compiled on first use: their keys hold that code, so a changed kernel or
    runner never reuses a verify or quality report it did not make. Checked on a copy of the installed tree."""
    import importlib.util
    import shutil

    from checkpoints import REPO

    spec = importlib.util.spec_from_file_location("lint_imports", REPO / "scripts" / "lint_imports.py")
    lint_imports = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lint_imports)
    lint_imports.make_view(REPO, tmp_path / "view")  # llmc/ laid out as installed, made of links
    site = tmp_path / "site"
    shutil.copytree(tmp_path / "view", site, ignore=shutil.ignore_patterns("__pycache__"))  # links followed
    kernels = site / "llmc" / "runtime" / "kernels"
    sources = sorted(p for p in kernels.rglob("*") if p.suffix in (".c", ".h"))
    assert {p.parent.name for p in sources} >= {"kernels", "matmul_nbits4", "paged_attention"}
    changed = [*map(str, sources), str(site / "llmc" / "runtime" / "runners" / "paged.py")]
    res = subprocess.run([sys.executable, "-c", KEY_PROBE, *changed], capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(site), "PYTHONSAFEPATH": "1", "PATH": "/usr/bin:/bin"}, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    keys = json.loads(res.stdout)
    base = keys.pop("unchanged")
    assert keys.keys() == set(changed)
    for path, key in keys.items():
        assert key["verify"] != base["verify"], f"{path}: a changed byte left the verify key as it was"
        assert key["quantize code"] != base["quantize code"], f"{path}: the quantize stage's code hash did not change"


def test_a_stage_sees_only_the_earlier_results_it_declared(tiny_llama, tmp_path, monkeypatch):
    """ctx.done holds what a stage takes and reads, nothing else; the stage that opens the build is known by
    its declaration (`opens`), not its name: every later stage gets the checkpoint it found."""
    from dataclasses import replace

    from llmc.compiler.pipeline import run
    from llmc.compiler.source import SOURCE
    from llmc.compiler.stage import Stage

    seen = {}

    def recorder(name):
        def record(taken, section, ctx):
            seen[name] = (taken.artifact if taken else None, sorted(ctx.done), ctx.source.path)
            return name
        return record

    table = (replace(SOURCE, name="checkpoint"),
             Stage("a", describe=str, run=recorder("a"), summary=str),
             Stage("b", describe=str, takes=("a",), run=recorder("b"), summary=str),
             Stage("c", describe=str, takes=("b",), reads=("checkpoint",), run=recorder("c"), summary=str))
    monkeypatch.setattr(run, "STAGES", table)
    monkeypatch.setattr(run, "STAGE_NAMES", tuple(s.name for s in table))
    run.build(parse_spec({"name": "t", "source": str(tiny_llama)}), output=tmp_path / "out", until="c")
    assert seen == {"a": (None, [], tiny_llama), "b": ("a", ["a"], tiny_llama),
                    "c": ("b", ["b", "checkpoint"], tiny_llama)}


def test_the_pytorch_model_is_freed_after_the_last_stage_that_runs_it(tiny_llama, tmp_path, monkeypatch):
    """A stage declares `loads_model`; later stages (quantize holds the graph's weights several times) run
    without the PyTorch copy. Every stage that calls ctx.model declares it."""
    import inspect

    from llmc.compiler.pipeline import run
    from llmc.compiler.pipeline.stages import STAGES
    from llmc.compiler.source import SOURCE
    from llmc.compiler.stage import Stage

    for stage in STAGES:
        assert ("ctx.model" in inspect.getsource(inspect.getmodule(stage.run))) == stage.loads_model, stage.name
    held = {}

    def using(name):
        def go(taken, section, ctx):
            held[name] = ctx.model._loaded is not None
            if name == "a":
                ctx.model()
            return name
        return go

    monkeypatch.setattr(run, "load_model", lambda info: ("model", "tokenizer"))
    table = (SOURCE, Stage("a", describe=str, run=using("a"), summary=str, loads_model=True),
             Stage("b", describe=str, run=using("b"), summary=str, loads_model=True),
             Stage("c", describe=str, run=using("c"), summary=str))
    monkeypatch.setattr(run, "STAGES", table)
    monkeypatch.setattr(run, "STAGE_NAMES", tuple(s.name for s in table))
    run.build(parse_spec({"name": "t", "source": str(tiny_llama)}), output=tmp_path / "out", until="c")
    assert held == {"a": False, "b": True, "c": False}
