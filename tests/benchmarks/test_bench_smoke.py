"""Every registered benchmark (llmc/bench/registry.py) run tiny: a smoke run, not a timing, so a changed default
(the paged graph, a runner's protocol, a spec field) breaks a test rather than the next benchmark run.

Benchmarks run in process (`python -m llmc.bench NAME ARGS` as llmc.bench.__main__.main): no interpreter or torch
import per benchmark. A test that runs one fully is marked `@smokes(NAME)`; the rest are in HELP_ONLY: they build
and measure SmolLM2 variants of their own (minutes even tiny, as each builds several graphs or servers), so their
argument parsing and imports are checked (`--help`). A benchmark added to the registry with neither fails
test_every_registered_benchmark_is_smoked.

Fully run on the tiny Llama: sampling, cpu-kernels, paged-attention, quantization (llmc's fp32/int8/int4 builds of
the default graph; the onnxruntime-genai peer left out: its builder costs ~25 s a precision here), peers (the
shared tiny build served by Triton; genai left out likewise), sizes, moe (its op curve), collective,
tensor-parallel; q4-stream on three tiny random layers.
gpu-kernels: run tiny on a GPU, else checked to stop with its message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmc.bench import registry
from llmc.bench.__main__ import main as bench_main
from llmc.runtime.kernels import cpu_kernels

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts"
SMOKED: set[str] = set()  # benchmarks some test below runs fully (filled by @smokes as this file loads)
HELP_ONLY = {"attention", "beam", "draft", "kv-cache-dtype", "openai", "paged", "paged-graph", "triton",
             "speculative", "structured"}


def smokes(name: str):
    """Mark a test as the full smoke run of benchmark `name`."""
    SMOKED.add(name)
    return lambda test: test


def run_bench(monkeypatch, name: str, *args: str) -> None:
    """`python -m llmc.bench name args...`, in this process, one ONNX Runtime / OpenMP thread."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    bench_main([name, *args])


def test_every_registered_benchmark_is_smoked():
    names = {bench.name for bench in registry.BENCHMARKS}
    assert len(names) == len(registry.BENCHMARKS), "two benchmarks share a name"
    assert not SMOKED & HELP_ONLY, "a benchmark both run fully and only --help'd: drop it from HELP_ONLY"
    assert names == SMOKED | HELP_ONLY, "a registered benchmark without a smoke test (add one above, or to HELP_ONLY)"
    assert {bench.group for bench in registry.BENCHMARKS} <= set(registry.GROUPS)


def test_scripts_hold_no_benchmark():
    """Benchmarks live in llmc/bench/, registered; scripts/ keeps the setup, the checks and the soak's runner."""
    assert {p.name for p in SCRIPTS.glob("*.py")} == {"check_stock_container.py",
                                                       "lint_imports.py", "prepare_example.py", "soak.py"}


def test_list_names_every_benchmark_by_group(capsys):
    bench_main(["--list"])
    out = capsys.readouterr().out
    for bench in registry.BENCHMARKS:
        group = out.index(f"\n{bench.group}:\n")
        assert out.index(f"\n  {bench.name} ", group) > group, bench.name
        assert bench.summary and bench.summary in out, bench.name


def test_an_unknown_benchmark_is_named_with_the_known_ones():
    with pytest.raises(SystemExit) as exit_:
        bench_main(["no-such-bench"])
    assert "no benchmark 'no-such-bench'" in str(exit_.value.code) and "sizes" in str(exit_.value.code)


def test_an_argument_a_benchmark_refuses_exits_as_argparse_does(capsys):
    """run() raising UsageError: usage and the message on stderr, exit 2 (as a parse error would)."""
    with pytest.raises(SystemExit) as exit_:
        bench_main(["sizes", "--modes", "fp64", "--peers", "none"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "usage: python -m llmc.bench sizes" in err and "--modes: unknown ['fp64']" in err


@pytest.mark.parametrize("name", sorted(bench.name for bench in registry.BENCHMARKS))
def test_arguments_parse(monkeypatch, capsys, name):
    with pytest.raises(SystemExit) as exit_:
        run_bench(monkeypatch, name, "--help")
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: python -m llmc.bench {name} ")


@smokes("sampling")
def test_bench_sampling(monkeypatch, capsys):
    run_bench(monkeypatch, "sampling", "--passes", "1", "--rows", "1,4")
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in lines[1:]] == [[mix, rows] for mix in ("greedy", "sampled", "mixed")
                                                        for rows in ("1", "4")]


@smokes("cpu-kernels")
def test_bench_cpu_kernels(monkeypatch, capsys):
    run_bench(monkeypatch, "cpu-kernels", "--threads", "1", "--rows", "1", "--repeats", "1", "--fp32", "--block", "64")
    out = capsys.readouterr().out
    assert "onnxruntime" in out and "fp32 MatMul" in out and "181 4-bit linear layers in blocks of 64" in out
    row = next(line.split() for line in out.splitlines() if line.split()[:1] == ["1"])
    assert len(row) == 1 + 2 * (out.count("llmc ") + 2)  # rows, then each kernel's ms and ratio


@smokes("q4-stream")
@pytest.mark.skipif(cpu_kernels.load() is None, reason="llmc's 4-bit kernel does not run on this host")
def test_bench_q4_stream(monkeypatch, capsys):
    run_bench(monkeypatch, "q4-stream", "--k", "128", "--n", "64", "--layers", "3", "--copies", "1", "--rounds", "2",
              "--reps", "2", "--blocks", "32,128")
    out = capsys.readouterr().out
    assert "3 layers of 128 x 64" in out and "GB/s" in out and out.count("of the read (per round") == 4
    assert "blocks of 128 against 32 (fp16 scales):" in out


@smokes("paged-attention")
def test_bench_paged_attention(monkeypatch, capsys):
    run_bench(monkeypatch, "paged-attention", "--threads", "1", "--layers", "1", "--repeats", "1", "--iterations", "1")
    out = capsys.readouterr().out
    assert out.count("llmc PagedAttention") >= 2  # the decode and the prefill ratio


@smokes("lora-delta")
@pytest.mark.skipif(cpu_kernels.load() is None, reason="llmc's CPU kernels do not run on this host")
def test_bench_lora_delta(monkeypatch, capsys):
    run_bench(monkeypatch, "lora-delta", "--tokens", "3", "--slots", "2", "--rank", "2", "--runs", "1",
              "--threads", "1", "--isas")
    out = capsys.readouterr().out
    assert out.count("branch ") == 4 and out.count("fused ") >= 8  # each site: the branch, fused and per-ISA ratios


@smokes("gpu-kernels")
def test_bench_gpu_kernels(monkeypatch, capsys):
    """Run tiny on a GPU; without one, refused with its message (a usage error, exit 2)."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        run_bench(monkeypatch, "gpu-kernels", "--batch", "2", "--context", "128", "--heads", "4", "--kv-heads", "2",
                  "--head-dim", "64", "--passes", "1")
        assert "vs SDPA" in capsys.readouterr().out
        return
    with pytest.raises(SystemExit) as exit_:
        run_bench(monkeypatch, "gpu-kernels", "--passes", "1")
    assert exit_.value.code == 2 and "needs an NVIDIA GPU" in capsys.readouterr().err


@smokes("quantization")
def test_bench_quantization_on_the_paged_default(monkeypatch, tiny_checkpoints, tmp_path):
    """The example's default graph (paged) quantized and decoded through the paged runner (it crashed
    on OrtRunner's slot protocol)."""
    run_bench(monkeypatch, "quantization", "--threads", "1", "--passes", "1", "--model",
              str(tiny_checkpoints["llama"]), "--out", str(tmp_path), "--prompt-tokens", "8", "--new-tokens", "4",
              "--no-genai")
    result = json.loads((tmp_path / "quantization.json").read_text())
    assert result["graph"] == "paged"
    assert set(result["medians"]) == {"llmc fp32 tok/s", "llmc int8 tok/s", "llmc int4 tok/s"}
    assert all(v > 0 for v in result["medians"].values())
    assert set(result["ratios"]) == {"int8", "int4"}


@smokes("peers")
@pytest.mark.triton
def test_compare_peers(monkeypatch, tiny_checkpoints, tiny_build, tmp_path):
    """Every pass its own prompt; llmc's TTFT both for the new prompt and for it sent again (a cache hit)."""
    from serving_rig import serving_env

    serving_env()
    run_bench(monkeypatch, "peers", "--threads", "1", "--passes", "2", "--prompt-tokens", "16", "--new-tokens", "4",
              "--model", str(tiny_checkpoints["llama"]), "--build", str(tiny_build.output), "--out", str(tmp_path),
              "--skip", "genai")
    result = json.loads((tmp_path / "peers.json").read_text())
    assert list(result["table"]) == ["HF transformers generate()", "llmc in process", "llmc through Triton"]
    assert len(result["prompt_tokens"]) == 2 and min(result["prompt_tokens"]) >= 16
    for name in ("llmc in process", "llmc through Triton"):
        assert result["table"][name]["ttft_cached_ms"] is not None
        assert all(len(p) == 4 for p in result["passes"][name])
    assert result["table"]["HF transformers generate()"]["ttft_cached_ms"] is None


@smokes("sizes")
def test_bench_sizes_on_a_tiny_checkpoint(monkeypatch, capsys, tiny_checkpoints, tmp_path):
    """The real-size benchmark's whole path on the tiny Llama (--checkpoint instead of a shape; no peers):
    the build timed with its peak memory beside the dry run's estimate, decode, prefill and concurrent streams
    measured, the roofline share from the graph's bytes."""
    run_bench(monkeypatch, "sizes", "--checkpoint", str(tiny_checkpoints["llama"]), "--modes", "fp32", "--peers",
              "none", "--passes", "1", "--threads", "1", "--prompt-tokens", "8", "--new-tokens", "4",
              "--prefill-tokens", "16", "--streams", "3", "--out", str(tmp_path))
    result = json.loads((tmp_path / "sizes.json").read_text())
    row = result["shapes"][tiny_checkpoints["llama"].name]["llmc fp32"]
    assert row["decode_tok_s"] > 0 and row["prefill_tok_s"] > 0 and 0 < row["roofline_share"]
    assert row["peak_build_bytes"] >= row["peak_build_anonymous_bytes"] > 0 and row["estimate_bytes"] > 0
    assert row["build_s"] > 0
    assert row["step_bytes"] > 0
    assert row["streams_tok_s"] > 0 and 0 < row["streams_itl_p50_s"] <= row["streams_itl_p99_s"]
    assert 0 < row["streams_ttft_p50_s"] <= row["streams_ttft_p99_s"]
    out = capsys.readouterr().out
    assert "| fp32 | llmc |" in out and "3 streams, 6 requests of 8 + 4 tokens" in out


@smokes("lora")
def test_bench_lora_tiny(monkeypatch, tiny_checkpoints, tmp_path):
    """The LoRA benchmark's whole path on the tiny Qwen3-MoE built int4: PEFT adapters made (on its experts too) and
    built in, the four traffic mixes timed against a runner without the LoRA graph, adapters loaded at run time and
    held, one loaded from disk."""
    run_bench(monkeypatch, "lora", "--checkpoint", str(tiny_checkpoints["qwen3_moe"]), "--passes", "1", "--streams",
              "3", "--prompt-tokens", "8", "--new-tokens", "3", "--rank", "4", "--adapters", "2", "--held", "3",
              "--threads", "1", "--mode", "int4-weight-only", "--out", str(tmp_path))
    result = json.loads((tmp_path / "lora.json").read_text())
    assert (result["checkpoint"], result["mode"]) == ("qwen3_moe", "int4-weight-only")
    # q/k/v and o in each of 3 layers, the dense layer's MLP (3), the untied LM head, the 2 sparse layers' fc1 and fc2
    assert result["manifest_sites"] == 3 * 2 + 3 + 1 + 2 * 2
    assert set(result["tok_s"]) == {"base", "base_enabled", "one_adapter", "four_adapters"}
    assert all(v > 0 for v in result["tok_s"].values()) and result["ratios"]["four_adapters/base"] > 0
    # two pairs of engines (the default), each ratio taken within a pair and pooled
    assert result["copies"] == 2 and all(len(v) == 2 and min(v) > 0 for v in result["by_pair"].values())
    assert len(result["lockstep"]["per_pass"]["base_enabled"]) == 2
    assert result["held"] == 3 and result["held_bytes"] > 0
    assert 0 < result["load_s"]["convert"] <= result["load_s"]["until_served"] < result["load_s"]["until_first_token"]
    assert result["ttft_s"]["first_request"] > 0 and result["ttft_s"]["warm_adapter"] > 0
    assert result["ttft_s"]["first_request_busy"] > 0 and result["staged"] == (1 if result["lora_fusion"] else 0)
    run_bench(monkeypatch, "lora", "--checkpoint", str(tiny_checkpoints["qwen3_moe"]), "--passes", "1", "--streams",
              "3", "--prompt-tokens", "8", "--new-tokens", "3", "--rank", "4", "--adapters", "2", "--held", "3",
              "--threads", "1", "--mode", "int4-weight-only", "--out", str(tmp_path), "--loading-only")  # built: reused
    result = json.loads((tmp_path / "lora.json").read_text())
    assert "tok_s" not in result and "lockstep" not in result and result["ttft_first/warm"] > 0


@smokes("moe")
def test_bench_moe_op_curve_tiny(monkeypatch, tmp_path):
    """The expert op's curve at a tiny width (fp32 MoE and llmc's int4 QMoE); its decode passes build and time
    through the peers' plug-ins as the sizes benchmark does (smoked above)."""
    run_bench(monkeypatch, "moe", "--skip-models", "--hidden", "64", "--threads", "1", "--out", str(tmp_path))
    result = json.loads((tmp_path / "moe.json").read_text())
    assert set(result["op"]) == {"fp32", "int4"}
    assert all(ms > 0 for curve in result["op"].values() for ms in curve.values())
    assert "16 rows, 16 experts" in result["op"]["int4"] and "1 rows, 2 experts" in result["op"]["fp32"]


@smokes("collective")
def test_bench_collective_tiny(monkeypatch, capsys, tmp_path):
    """AllReduce between two real rank processes (`python -m llmc.bench collective --worker` each), two tiny
    sizes."""
    run_bench(monkeypatch, "collective", "--ranks", "2", "--sizes", "1x8,2x5", "--calls", "5", "--warmup", "1",
              "--nodes", "2", "--out", str(tmp_path / "collective.json"))
    result = json.loads((tmp_path / "collective.json").read_text())
    assert set(result) == {"2"} and set(result["2"]) == {"1x8", "2x5"}
    assert all(us >= 0 for us in result["2"].values())
    assert "Share of a step" in capsys.readouterr().out


@smokes("tensor-parallel")
def test_bench_tensor_parallel_tiny(monkeypatch, capsys, tiny_checkpoints, tmp_path):
    """The tiny Llama whole and split over 2 ranks, one pass each, and the collectives' share of a step."""
    run_bench(monkeypatch, "tensor-parallel", "--checkpoint", str(tiny_checkpoints["llama"]), "--passes", "1",
              "--new-tokens", "4", "--streams", "2", "--prompt-tokens", "8", "--collective-calls", "20", "--out",
              str(tmp_path))
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["ranks"] == 2 and set(result["table"]) == {"decode_tok_s", "streams_tok_s", "itl_p50_ms",
                                                             "itl_p99_ms"}
    assert all(row["whole"] > 0 and row["split"] > 0 for row in result["table"].values())
    assert "collectives at 1 row(s)" in capsys.readouterr().out


@smokes("streamed")
def test_bench_streamed_tiny(monkeypatch, capsys, tmp_path):
    """One tiny bf16 checkpoint in shards, built reading its layers, measured beside the dry run's estimate."""
    run_bench(monkeypatch, "streamed", "--hidden", "64", "--intermediate", "128", "--layers", "2", "--loads", "layers",
              "--quantization", "int4-weight-only", "--algorithm", "rtn", "--out", str(tmp_path))
    result = json.loads((tmp_path / "streamed.json").read_text())
    build = result["builds"]["2"]["layers"]
    assert build["build_s"] > 0 and build["peak_gib"] > 0 and build["estimate_gib"] > 0
    assert {"export", "verify", "quantize"} <= set(build["stages"])
    assert all(s["peak_gib"] > 0 and "disk_gib" in s for s in build["stages"].values())
    assert build["disk_kept_gib"] > 0 and build["disk_kept_estimate_gib"] > 0 and build["disk_estimate_gib"] > 0
    assert result["algorithm"] == "rtn" and "quality" in build  # the quantize stage ran, round to nearest
    assert "2 layers, load layers" in capsys.readouterr().out
