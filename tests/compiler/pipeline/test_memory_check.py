"""The memory check: each stage's peak beside the machine's available memory, and the refusal (dry run and
real build alike, before any work) of a build whose largest stage cannot fit, naming the stage, its
estimate and what would make it fit."""

import json
import math
import os
import platform
from pathlib import Path

import pytest

from llmc.compiler import build
from llmc.compiler.pipeline import memory
from llmc.compiler.pipeline.memory import return_freed_memory
from llmc.compiler.pipeline.plan import BASE, BUILD_PEAK, check_plan_memory, plan_build
from llmc.compiler.spec import parse_spec
from llmc.errors import ResourceError

GiB = 2**30
LIMITS = {"max_batch_size": 4, "max_seq_len": 96, "max_num_tokens": 64}
# Llama-3.1-70B's published config.json (its shape fields)
LLAMA_70B = {"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
             "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
             "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
             "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
             "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}


def _spec(ckpt, **extra):
    return parse_spec({"name": "p", "source": str(ckpt), "limits": LIMITS, "serving": {"default_max_tokens": 8},
                       **extra})


def config_checkpoint(folder: Path, config: dict) -> Path:
    """A config-only checkpoint: the plan reads config.json; the weights file only has to be there."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(b"")
    return folder


@pytest.fixture
def llama_70b(tmp_path):
    return config_checkpoint(tmp_path / "llama-3.1-70b", LLAMA_70B)


@pytest.fixture
def machine_24gib(monkeypatch):
    monkeypatch.delenv(memory.OVERRIDE_ENV, raising=False)
    monkeypatch.setattr(memory, "available_bytes", lambda *a, **k: 24 * GiB)


def test_a_70b_int4_plan_gives_each_stage_its_peak_and_is_refused_naming_the_stage(llama_70b, machine_24gib):
    plan = plan_build(_spec(llama_70b, quantization={"mode": "int4-weight-only"}))
    assert 70e9 < plan.total_params < 71e9
    assert set(plan.stage_peak_bytes) == {"export", "verify", "quantize"}
    fp32 = 4 * plan.total_params
    assert plan.load == "layers"  # auto: the whole model's stages would not fit; nor do its layers
    w, u, _ = BUILD_PEAK["quantize"]
    assert plan.stage_peak_bytes["quantize"] < BASE + w * fp32  # read a layer at a time: less than whole
    stage, peak = max(plan.stage_peak_bytes.items(), key=lambda item: item[1])
    assert peak == plan.build_peak_bytes > 24 * GiB
    rows = dict(plan.rows())
    assert rows[f"build: {stage} peak (estimate)"] == f"{peak / GiB:.2f} GiB"
    assert rows["build: this machine's available memory"] == "24.00 GiB"
    needed = peak / GiB
    with pytest.raises(ResourceError, match=rf"the {stage} stage needs about {needed:.1f} GiB .* this machine has "
                                            rf"24\.0 GiB available; it would fit on a machine with at least "
                                            rf"{math.ceil(needed)} GiB") as err:
        check_plan_memory(plan)
    # no spec field makes a 70B fit 24 GiB: the export alone needs more, so none is offered
    assert "quantization.mode" not in str(err.value) and "verify.enabled" not in str(err.value)


def test_the_override_plans_it(llama_70b, machine_24gib, monkeypatch):
    plan = plan_build(_spec(llama_70b, quantization={"mode": "int4-weight-only"}))
    check_plan_memory(plan, ignore=True)
    monkeypatch.setenv(memory.OVERRIDE_ENV, "1")
    check_plan_memory(plan)


def test_a_real_build_is_refused_before_any_work(llama_70b, machine_24gib, tmp_path):
    """The empty weights file would fail the source stage: the refusal comes first, and nothing is written."""
    with pytest.raises(ResourceError, match="the (export|verify|quantize) stage needs"):
        build(_spec(llama_70b, quantization={"mode": "int4-weight-only"}), output=tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_the_fix_offered_is_the_spec_field_that_removes_the_stage_at_fault():
    peaks = {"export": 10 * GiB, "verify": 12 * GiB, "quantize": 30 * GiB}
    assert "quantization.mode: none (the build's other stages peak at 12.0 GiB)" in memory.memory_refusal(peaks, 20 * GiB)
    assert "verify.enabled: false (the build's other stages peak at 10.0 GiB)" in memory.memory_refusal(
        {"export": 10 * GiB, "verify": 12 * GiB}, 11 * GiB)
    assert memory.memory_refusal(peaks, 30 * GiB) is None and memory.memory_refusal(peaks, None) is None


def test_a_tiny_model_passes(tiny_llama, machine_24gib):
    plan = plan_build(_spec(tiny_llama, quantization={"mode": "int4-weight-only"}))
    assert plan.build_peak_bytes < BASE + 0.1 * GiB  # the interpreter and its libraries, little more
    check_plan_memory(plan)


MEMINFO = """MemTotal:       24684084 kB
MemFree:        17910648 kB
MemAvailable:   20971520 kB
Buffers:          123456 kB
"""


def test_the_memory_reader_takes_memavailable_capped_by_the_cgroup_limit(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(MEMINFO)
    v2, v1 = tmp_path / "memory.max", tmp_path / "memory.limit_in_bytes"
    assert memory.available_bytes(meminfo, (v2, v1)) == 20 * GiB  # no cgroup files: MemAvailable
    v2.write_text("max\n")
    v1.write_text("9223372036854771712\n")  # v1's "no limit"
    assert memory.available_bytes(meminfo, (v2, v1)) == 20 * GiB
    v2.write_text(f"{8 * GiB}\n")
    assert memory.available_bytes(meminfo, (v2, v1)) == 8 * GiB
    v2.unlink()
    v1.write_text(f"{16 * GiB}\n")
    assert memory.available_bytes(meminfo, (v2, v1)) == 16 * GiB
    v1.write_text(f"{32 * GiB}\n")  # a limit above what is free: MemAvailable
    assert memory.available_bytes(meminfo, (v2, v1)) == 20 * GiB
    assert memory.available_bytes(tmp_path / "absent", (v2, v1)) is None


def test_a_70b_int4_dry_run_says_what_it_needs_and_is_refused_unless_overridden(llama_70b, tmp_path):
    """The command itself, on this machine's own memory: the int4 quantize stage of a 70B needs ~790 GiB,
    past any machine these tests run on; the dry run prints the plan, names the stage and exits 12, and
    --ignore-memory-check prints the plan with each stage's peak."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from checkpoints import write_spec

    available = memory.available_bytes()
    if available is None or available > 700 * GiB:
        pytest.skip("this machine's memory is unknown, or large enough for a 70B build")
    spec = write_spec(tmp_path, {"name": "m", "source": str(llama_70b), "quantization": {"mode": "int4-weight-only"}})
    env = {**{k: v for k, v in os.environ.items() if k != memory.OVERRIDE_ENV}, "COLUMNS": "250"}
    llmc = [str(Path(sys.executable).parent / "llmc"), "build", str(spec), "--dry-run"]
    res = subprocess.run(llmc, capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 12, res.stdout + res.stderr
    assert " stage needs about" in res.stderr and "--ignore-memory-check" in res.stderr
    assert "build: quantize peak" in res.stdout  # the plan is printed first: what each stage needs
    res = subprocess.run(llmc + ["--ignore-memory-check", "--ignore-disk-check"], capture_output=True, text=True,
                         env=env, timeout=600)  # its ~310 GiB of disk is refused too (test_disk_check.py)
    assert res.returncode == 0, res.stderr
    for row in ("build: export peak", "build: verify peak", "build: quantize peak", "available memory"):
        assert row in res.stdout


def _resident_mib() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not Path("/proc/self/statm").is_file() or platform.libc_ver()[0] != "glibc",
                    reason="glibc's malloc_trim and /proc's resident set")
def test_a_stage_boundary_returns_what_the_stage_freed():
    """Small arrays freed stay in glibc's heap (a stage's peak would stay resident under the next stage) until
    the boundary's trim returns them."""
    import numpy as np

    # ~320 MB of 8 KB chunks, under mmap's threshold. Every eighth stays alive, the last one allocated among them:
    # the freed runs sit inside the heap, where free() never gives pages back (it trims only the heap's top, which
    # it did once in CI when everything was freed from the top down).
    held = [np.full(1000, i, dtype=np.float64) for i in range(40_000)]
    pinned = held[7::8]
    before = _resident_mib()
    del held
    freed = _resident_mib()
    assert before - freed < 100, "glibc returned the freed chunks itself: nothing left for the trim to test"
    assert return_freed_memory()
    assert freed - _resident_mib() > 200
    assert len(pinned) == 5000
