"""The `llmc` command: readable one-line errors with exit codes, build/export/verify/inspect, --help."""

import json
import os
import subprocess
import sys
from pathlib import Path

from checkpoints import write_spec

LLMC = Path(sys.executable).parent / "llmc"


def run(*args, cwd=None):
    env = {**os.environ, "COLUMNS": "250"}  # wide enough that rich does not wrap table cells
    return subprocess.run([str(LLMC), *map(str, args)], capture_output=True, text=True, cwd=cwd, env=env, timeout=600)


def test_help_teaches_the_commands():
    res = run("--help")
    assert res.returncode == 0
    for cmd in ("build", "export", "verify", "inspect"):
        assert cmd in res.stdout
    build_help = run("build", "--help").stdout
    assert "--output" in build_help and "--force" in build_help and "atomically" in build_help
    assert "--ignore-memory-check" in build_help


def test_bad_spec_is_one_readable_message(tmp_path):
    spec = write_spec(tmp_path, {"name": "m", "source": "x", "limits": {"max_batch_size": -1}})
    res = run("build", spec)
    assert res.returncode == 2
    assert "limits.max_batch_size" in res.stderr and str(spec) in res.stderr
    assert "Traceback" not in res.stderr + res.stdout


def test_debug_shows_the_traceback(tmp_path):
    res = run("--debug", "build", tmp_path / "missing.yaml")
    assert res.returncode != 0 and "Traceback" in res.stderr and "SpecError" in res.stderr


def test_missing_source_exit_code(tmp_path):
    res = run("build", write_spec(tmp_path, {"name": "m", "source": "nowhere"}))
    assert res.returncode == 3 and "source.path" in res.stderr and "does not exist" in res.stderr


def test_build_then_inspect(tiny_checkpoints, tmp_path):
    spec = write_spec(tmp_path, {"name": "tiny-gpt2", "source": str(tiny_checkpoints["gpt2"])})
    res = run("build", spec, cwd=tmp_path)  # default output: build/<name> under the working directory
    assert res.returncode == 0, res.stderr
    out = tmp_path / "build" / "tiny-gpt2"
    assert "greedy tokens equal over 32 steps" in res.stdout
    assert "✓ export" in res.stderr and "✓ verify" in res.stderr  # per-stage lines with timings
    again = run("build", spec, cwd=tmp_path)
    assert again.returncode == 0 and "cached" in again.stdout

    shown = run("inspect", out).stdout
    for text in ("input_ids", "int64[num_tokens]", "block_table", "past_key_values.0.key .. past_key_values.1.value",
                 "present.0.key", "opset", "23", "sha256 model.onnx", "passed", "batch-3", "paged attention",
                 "a KV pool of 16384 tokens in blocks of 16"):  # the default: the paged graph, 8 x 2048 tokens
        assert text in shown, text
    graph = run("inspect", out / "export" / "model.onnx")
    assert graph.returncode == 0 and "ai.onnx 23" in graph.stdout and "Attention" in graph.stdout
    assert run("inspect", tmp_path).returncode == 6


def test_export_and_verify_commands(tiny_llama, tmp_path):
    spec = write_spec(tmp_path, {"name": "m", "source": str(tiny_llama), "verify": {"decode_steps": 4}})
    out = tmp_path / "out"
    res = run("export", spec, "-o", out)
    assert res.returncode == 0, res.stderr
    assert (out / "export" / "model.onnx").is_file() and not (out / "verify").exists()
    res = run("verify", spec, "-o", out)
    assert res.returncode == 0, res.stderr
    assert "cached" in res.stdout and (out / "verify" / "verify.json").is_file()


def test_tensorrt_target_exports_but_does_not_build(tiny_llama, tmp_path):
    spec = write_spec(tmp_path, {"name": "m", "source": str(tiny_llama), "target": "tensorrt"})
    res = run("export", spec, "-o", tmp_path / "out")
    assert res.returncode == 0, res.stderr
    assert "plugin attention" in res.stdout
    res = run("build", spec, "-o", tmp_path / "out2")
    assert res.returncode == 7 and "llmc export" in res.stderr and "target: onnxruntime" in res.stderr


def test_dry_run_prints_the_plan_and_builds_nothing(tiny_llama, tmp_path):
    spec = write_spec(tmp_path, {"name": "m", "source": str(tiny_llama), "target": "tensorrt", "precision": "bf16"})
    res = run("build", spec, "--dry-run", "-o", tmp_path / "out")
    assert res.returncode == 0, res.stderr
    for row in ("profile prefill", "profile decode", "memory: KV cache", "bf16 through ModelOpt AutoCast",
                "build: peak memory"):
        assert row in res.stdout
    assert not (tmp_path / "out").exists()
    res = run("build", spec, "--dry-run", "--json")  # the same plan as data, for scripts
    plan = json.loads(res.stdout)
    assert plan["target"] == "tensorrt" and plan["build_peak_bytes"] > 0 and len(plan["profiles"]) == 2


def test_minimal_spec_takes_its_limits_from_the_checkpoint_and_prints_only_llmc(tmp_path):
    """`name` + `source` build any supported checkpoint, also one made for contexts below 2048 tokens;
    the command prints llmc's own lines only (no library warnings)."""
    import json

    from checkpoints import make_checkpoint

    ckpt = make_checkpoint("qwen2", tmp_path / "qwen2", max_position_embeddings=1024)
    spec = write_spec(tmp_path, {"name": "q", "source": str(ckpt)})
    res = run("build", spec, "-o", tmp_path / "out")
    assert res.returncode == 0, res.stderr
    assert "limits.max_seq_len 1024 (the model's max_position_embeddings is 1024)" in res.stdout
    manifest = json.loads((tmp_path / "out" / "model_repository" / "q" / "1" / "manifest.json").read_text())
    assert manifest["limits"]["max_seq_len"] == 1024 and manifest["limits"]["default_max_tokens"] == 256
    for line in (res.stdout + res.stderr).splitlines():
        assert "Warning" not in line and "deprecated" not in line, line
