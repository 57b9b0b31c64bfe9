"""The disk check (pipeline/disk.py): what each stage keeps and peaks at on the output's file system, the refusal of
a fresh build that cannot fit before any work (dry run and real build alike), naming the stage where the disk would
run out and what would make it fit, and a rebuild's stages checked one by one as they run, so that stages reused
by hard links are never counted."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from llmc.compiler import build
from llmc.compiler.pipeline import disk
from llmc.compiler.pipeline.disk import StageDisk, need, stage_disk
from llmc.compiler.pipeline.plan import plan_build
from llmc.compiler.spec import parse_spec
from llmc.errors import ResourceError

from tests.compiler.pipeline.test_memory_check import LLAMA_70B, _spec, config_checkpoint

GiB = 2**30
LLAMA_8B = {**LLAMA_70B, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
            "num_attention_heads": 32}


@pytest.fixture
def llama_8b(tmp_path):
    """Llama-3.1-8B's shape, config only."""
    return config_checkpoint(tmp_path / "llama-3.1-8b", LLAMA_8B)


@pytest.fixture
def free(monkeypatch):
    """The output's file system's free space, as the test sets it (GiB)."""
    monkeypatch.delenv(disk.OVERRIDE_ENV, raising=False)
    space = {"free": 1000 * GiB}
    monkeypatch.setattr(disk, "free_bytes", lambda folder: space["free"])
    return space


def test_an_8b_int4_build_keeps_its_fp32_export_and_its_int4_graph(llama_8b, tmp_path, free):
    plan = plan_build(_spec(llama_8b, quantization={"mode": "int4-weight-only"}), tmp_path / "out")
    stages = plan.disk.stages
    assert list(stages) == ["export", "verify", "quantize", "package"]
    assert stages["export"].kept == stages["export"].peak == 4 * plan.total_params  # 32 GB: the fp32 graph
    q = stages["quantize"]
    # codes, fp32 scales and 4-bit zero points in blocks of 32 (0.64 bytes a weight), the embeddings at fp32
    assert 6.5e9 < q.kept < 7.2e9 and q.peak == q.kept  # the scratch (no fp32 copy: the head is untied) is smaller
    assert stages["verify"] == StageDisk(0, 0)
    assert plan.disk.peak_bytes == plan.disk.kept_bytes == sum(s.kept for s in stages.values())  # all of it, kept
    assert 36 * GiB < plan.disk.peak_bytes < 37 * GiB
    rows = dict(plan.rows())
    assert rows["build: disk (estimate)"].startswith(f"{plan.disk.peak_bytes / GiB:.2f} GiB at the peak")
    assert rows["build: free disk"] == f"1000.00 GiB on {tmp_path}'s file system"


def test_a_tied_heads_fp32_copy_is_in_the_scratch_and_int8_keeps_a_byte_a_weight(llama_8b, tmp_path, free):
    (llama_8b / "config.json").write_text(json.dumps({**LLAMA_8B, "tie_word_embeddings": True}))
    tied = plan_build(_spec(llama_8b, quantization={"mode": "int4-weight-only"}), tmp_path / "o").disk.stages
    int8 = plan_build(_spec(llama_8b, quantization={"mode": "int8-weight-only"}), tmp_path / "o").disk.stages
    none = plan_build(_spec(llama_8b), tmp_path / "o").disk.stages
    assert "quantize" not in none
    # the untied head's fp32 copy, until quantized, beside the codes: the scratch outgrows the graph (untied: not)
    assert tied["quantize"].peak > tied["quantize"].kept
    table = 4 * 128256 * 4096  # the embeddings at fp32, in both graphs
    assert int8["quantize"].kept - table > 1.5 * (tied["quantize"].kept - table)  # a byte a weight against 0.64


def test_the_need_is_what_earlier_stages_kept_beside_the_running_ones_peak():
    stages = {"export": StageDisk(30, 30), "verify": StageDisk(0, 0), "quantize": StageDisk(6, 9),
              "package": StageDisk(1, 1)}
    assert need(stages) == 39
    assert need({"quantize": StageDisk(6, 9), "package": StageDisk(1, 1)}) == 9
    assert need({}) == 0


def test_a_fresh_build_that_cannot_fit_is_refused_before_any_work(llama_8b, tmp_path, free):
    """The empty weights file would fail the source stage: the refusal comes first, and nothing is written."""
    free["free"] = 20 * GiB
    with pytest.raises(ResourceError, match=r"would run out of disk in its export stage: it needs about 3\d\.\d GiB "
                                            r".* has 20\.0 GiB free; it would fit with 1\d GiB more freed there, or "
                                            r"with the output \(-o\) on a file system with at least 3\d GiB free") as err:
        build(_spec(llama_8b, quantization={"mode": "int4-weight-only"}), output=tmp_path / "out",
              ignore_memory_check=True)
    assert "--ignore-disk-check" in str(err.value)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))
    free["free"] = 34 * GiB  # the export fits; quantize's peak beside it does not
    with pytest.raises(ResourceError, match="in its quantize stage"):
        build(_spec(llama_8b, quantization={"mode": "int4-weight-only"}), output=tmp_path / "out",
              ignore_memory_check=True)
    with pytest.raises(Exception) as err:  # let through: the source stage then fails on the empty weights file
        build(_spec(llama_8b, quantization={"mode": "int4-weight-only"}), output=tmp_path / "out",
              ignore_memory_check=True, ignore_disk_check=True)
    assert not isinstance(err.value, ResourceError)


def test_a_rebuilds_reused_stages_take_no_space_and_each_stage_that_runs_is_checked(tiny_llama, tmp_path, free):
    spec = _spec(tiny_llama, quantization={"mode": "int4-weight-only", "algorithm": "rtn"},
                 verify={"enabled": False})
    first = build(spec, output=tmp_path / "out")
    needed = plan_build(spec, tmp_path / "other").disk.peak_bytes
    free["free"] = needed - 1
    with pytest.raises(ResourceError, match="would run out of disk"):  # a fresh output: all of it is written
        build(spec, output=tmp_path / "other")
    again = build(spec, output=tmp_path / "out")  # every stage is reused but the package (a few MB)
    assert {s.name: s.status for s in again.stages}["quantize"] == "cached"
    free["free"] = 2**20
    with pytest.raises(ResourceError, match="in its quantize stage"):  # quantize runs: its own peak is checked
        build(spec, output=tmp_path / "out", force={"quantize"})
    assert first.output.is_dir() and not list(tmp_path.glob(".out.staging*"))  # the last build stays as it was


def test_the_dry_run_refuses_a_fresh_output_that_cannot_fit_unless_overridden(llama_8b, tmp_path):
    """The command, on this machine's own disk: an output on a 1 MiB file system cannot be had here, so the 8B's
    ~37 GiB is checked against the real free space only where that is smaller; the override always plans it."""
    spec = tmp_path / "m.yaml"
    spec.write_text(f"name: m\nsource: {llama_8b}\nquantization:\n  mode: int4-weight-only\n")
    llmc = [str(Path(sys.executable).parent / "llmc"), "build", str(spec), "--dry-run", "--ignore-memory-check",
            "-o", str(tmp_path / "out")]
    env = {"COLUMNS": "250", "PATH": str(Path(sys.executable).parent)}
    plan = plan_build(parse_spec({"name": "m", "source": str(llama_8b),
                                  "quantization": {"mode": "int4-weight-only"}}), tmp_path / "out")
    res = subprocess.run(llmc, capture_output=True, text=True, env=env, timeout=300)
    fits = plan.disk.peak_bytes <= disk.free_bytes(tmp_path)
    assert res.returncode == (0 if fits else 12), res.stderr
    assert "build: disk (estimate)" in res.stdout and "build: free disk" in res.stdout
    if not fits:
        assert "would run out of disk in its" in res.stderr
    res = subprocess.run(llmc + ["--ignore-disk-check"], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr
