"""Every scripts/bench_*.py (and compare_peers.py) run tiny: a smoke run, not a timing, so a changed default
(the paged graph, a runner's protocol, a spec field) breaks a test rather than the next benchmark run.

Scripts run in process (runpy, as `__main__`, argv patched): no interpreter or torch import per script.
Fully run on the tiny Llama: bench_sampling, bench_cpu_kernels, bench_paged_attention, bench_quantization
(llmc's fp32/int8/int4 builds of the default graph; the onnxruntime-genai peer left out: its builder costs
~25 s a precision here) and compare_peers (the shared tiny build served by Triton; genai left out likewise);
bench_q4_stream on three tiny random layers.
bench_kernels needs CUDA: run tiny on a GPU, else checked to stop with its message. The rest build and
measure SmolLM2 variants of their own (minutes even tiny, as each builds several graphs or servers):
their argument parsing and imports are checked (`--help`)."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest

from llmc.runtime.kernels import cpu_kernels

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts"
LIBRARIES = {"bench_paged_builds.py", "bench_paged_decode.py"}  # imported by the others; no command line
RUN = {"bench_sampling.py", "bench_cpu_kernels.py", "bench_paged_attention.py", "bench_quantization.py",
       "bench_kernels.py", "compare_peers.py", "bench_sizes.py", "bench_moe.py", "bench_collective.py",
       "bench_tensor_parallel.py", "bench_q4_stream.py"}
HELP_ONLY = {"bench_attention.py", "bench_beam.py", "bench_draft.py", "bench_kv_cache_dtype.py", "bench_openai.py",
             "bench_paged.py", "bench_paged_graph.py", "bench_serving.py", "bench_speculative.py",
             "bench_structured.py"}


def run_script(monkeypatch, name: str, *args: str) -> None:
    """scripts/<name> as `python scripts/<name> args...`, in this process (sys.path restored after)."""
    monkeypatch.setattr(sys, "argv", [str(SCRIPTS / name), *args])
    monkeypatch.setattr(sys, "path", [str(SCRIPTS), *sys.path])  # as python puts a script's folder first
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    runpy.run_path(str(SCRIPTS / name), run_name="__main__")


def script_module(name: str):
    """scripts/<name>.py imported as a module (a helper of the bench scripts, not one run as __main__)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_bench_script_is_smoked():
    scripts = {p.name for p in SCRIPTS.glob("bench_*.py")} | {"compare_peers.py"}
    assert scripts - LIBRARIES == RUN | HELP_ONLY, "a benchmark script without a smoke test (add it above)"


@pytest.mark.parametrize("name", sorted(HELP_ONLY | RUN))
def test_arguments_parse(monkeypatch, capsys, name):
    with pytest.raises(SystemExit) as exit_:
        run_script(monkeypatch, name, "--help")
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("usage:")


def test_bench_sampling(monkeypatch, capsys):
    run_script(monkeypatch, "bench_sampling.py", "--passes", "1", "--rows", "1,4")
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in lines[1:]] == [[mix, rows] for mix in ("greedy", "sampled", "mixed")
                                                        for rows in ("1", "4")]


def test_bench_cpu_kernels(monkeypatch, capsys):
    run_script(monkeypatch, "bench_cpu_kernels.py", "--threads", "1", "--rows", "1", "--repeats", "1", "--fp32")
    out = capsys.readouterr().out
    assert "onnxruntime" in out and "fp32 MatMul" in out
    row = next(line.split() for line in out.splitlines() if line.split()[:1] == ["1"])
    assert len(row) == 1 + 2 * (out.count("llmc ") + 2)  # rows, then each kernel's ms and ratio


@pytest.mark.skipif(cpu_kernels.load() is None, reason="llmc's 4-bit kernel does not run on this host")
def test_bench_q4_stream(monkeypatch, capsys):
    run_script(monkeypatch, "bench_q4_stream.py", "--k", "128", "--n", "64", "--layers", "3", "--copies", "1",
               "--rounds", "2", "--reps", "2")
    out = capsys.readouterr().out
    assert "3 layers of 128 x 64" in out and "GB/s" in out and "of the read (per round" in out


def test_bench_paged_attention(monkeypatch, capsys):
    run_script(monkeypatch, "bench_paged_attention.py", "--threads", "1", "--layers", "1", "--repeats", "1",
               "--iterations", "1")
    out = capsys.readouterr().out
    assert out.count("llmc PagedAttention") >= 2  # the decode and the prefill ratio


def test_bench_kernels(monkeypatch, capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        run_script(monkeypatch, "bench_kernels.py", "--batch", "2", "--context", "128", "--heads", "4",
                   "--kv-heads", "2", "--head-dim", "64", "--passes", "1")
        return
    with pytest.raises(SystemExit) as exit_:
        run_script(monkeypatch, "bench_kernels.py", "--passes", "1")
    assert exit_.value.code == 2 and "needs an NVIDIA GPU" in capsys.readouterr().err


def test_bench_quantization_on_the_paged_default(monkeypatch, tiny_checkpoints, tmp_path):
    """The example's default graph (paged) quantized and decoded through the paged runner (it crashed
    on OrtRunner's slot protocol)."""
    run_script(monkeypatch, "bench_quantization.py", "--threads", "1", "--passes", "1", "--model",
               str(tiny_checkpoints["llama"]), "--out", str(tmp_path), "--prompt-tokens", "8", "--new-tokens", "4",
               "--no-genai")
    result = json.loads((tmp_path / "quantization.json").read_text())
    assert result["graph"] == "paged"
    assert set(result["medians"]) == {"llmc fp32 tok/s", "llmc int8 tok/s", "llmc int4 tok/s"}
    assert all(v > 0 for v in result["medians"].values())
    assert set(result["ratios"]) == {"int8", "int4"}


@pytest.mark.triton
def test_compare_peers(monkeypatch, tiny_checkpoints, tiny_build, tmp_path):
    """Every pass its own prompt; llmc's TTFT both for the new prompt and for it sent again (a cache hit)."""
    from conftest import serving_env

    serving_env()
    run_script(monkeypatch, "compare_peers.py", "--threads", "1", "--passes", "2", "--prompt-tokens", "16",
               "--new-tokens", "4", "--model", str(tiny_checkpoints["llama"]), "--build", str(tiny_build.output),
               "--out", str(tmp_path), "--skip", "genai")
    result = json.loads((tmp_path / "peers.json").read_text())
    assert list(result["table"]) == ["HF transformers generate()", "llmc in process", "llmc through Triton"]
    assert len(result["prompt_tokens"]) == 2 and min(result["prompt_tokens"]) >= 16
    for name in ("llmc in process", "llmc through Triton"):
        assert result["table"][name]["ttft_cached_ms"] is not None
        assert all(len(p) == 4 for p in result["passes"][name])
    assert result["table"]["HF transformers generate()"]["ttft_cached_ms"] is None


def test_bench_sizes_on_a_tiny_checkpoint(monkeypatch, capsys, tiny_checkpoints, tmp_path):
    """The real-size benchmark's whole path on the tiny Llama (--checkpoint instead of a shape; no peers):
    the build timed with its peak memory beside the dry run's estimate, decode, prefill and concurrent streams
    measured, the roofline share from the graph's bytes."""
    run_script(monkeypatch, "bench_sizes.py", "--checkpoint", str(tiny_checkpoints["llama"]), "--modes", "fp32",
               "--peers", "none", "--passes", "1", "--threads", "1", "--prompt-tokens", "8", "--new-tokens", "4",
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


def test_bench_moe_op_curve_tiny(monkeypatch, tmp_path):
    """The expert op's curve at a tiny width (fp32 MoE and llmc's int4 QMoE); its decode passes build through
    sized_builds and time through compare_peers as bench_sizes does (smoked above)."""
    run_script(monkeypatch, "bench_moe.py", "--skip-models", "--hidden", "64", "--threads", "1", "--out", str(tmp_path))
    result = json.loads((tmp_path / "moe.json").read_text())
    assert set(result["op"]) == {"fp32", "int4"}
    assert all(ms > 0 for curve in result["op"].values() for ms in curve.values())
    assert "16 rows, 16 experts" in result["op"]["int4"] and "1 rows, 2 experts" in result["op"]["fp32"]


def test_sized_checkpoints_have_the_published_parameter_counts():
    """The shapes are the models' own configs: counted on the meta device, each matches its published size;
    the tokenizer grows to the vocabulary, so every id a random model emits decodes."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    sized = script_module("sized_checkpoints")
    for shape, count in sized.PARAMETERS.items():
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(sized.config(shape))
        assert sum(p.numel() for p in model.parameters()) == count, shape
    tokenizer = Tokenizer.from_str(json.dumps(sized.grown_tokenizer(151936)))
    assert tokenizer.get_vocab_size() == 151936
    assert tokenizer.decode([151935], skip_special_tokens=False) == "<|filler_151935|>"


def test_bench_collective_tiny(monkeypatch, capsys, tmp_path):
    """AllReduce between two real rank processes (the script runs itself as each rank), two tiny sizes."""
    run_script(monkeypatch, "bench_collective.py", "--ranks", "2", "--sizes", "1x8,2x5", "--calls", "5", "--warmup",
               "1", "--nodes", "2", "--out", str(tmp_path / "collective.json"))
    result = json.loads((tmp_path / "collective.json").read_text())
    assert set(result) == {"2"} and set(result["2"]) == {"1x8", "2x5"}
    assert all(us >= 0 for us in result["2"].values())
    assert "Share of a step" in capsys.readouterr().out


def test_bench_tensor_parallel_tiny(monkeypatch, capsys, tiny_checkpoints, tmp_path):
    """The tiny Llama whole and split over 2 ranks, one pass each, and the collectives' share of a step."""
    run_script(monkeypatch, "bench_tensor_parallel.py", "--checkpoint", str(tiny_checkpoints["llama"]), "--passes",
               "1", "--new-tokens", "4", "--streams", "2", "--prompt-tokens", "8", "--collective-calls", "20",
               "--out", str(tmp_path))
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["ranks"] == 2 and set(result["table"]) == {"decode_tok_s", "streams_tok_s", "itl_p50_ms",
                                                             "itl_p99_ms"}
    assert all(row["whole"] > 0 and row["split"] > 0 for row in result["table"].values())
    assert "collectives at 1 row(s)" in capsys.readouterr().out


def test_a_llama_cpp_that_dies_is_named_not_a_vanished_run(monkeypatch, tmp_path):
    """llama.cpp generates in a child process: one dying by a signal (SIGILL: built for AMX in a VM that does not
    enable it) or failing raises naming the file and the cause, and the bench's own process lives on."""
    made = script_module("sized_builds")
    gguf = tmp_path / "model.gguf"
    monkeypatch.setattr(made, "TIMED_CHILD", "import os, signal\nos.kill(os.getpid(), signal.SIGILL)\n")
    with pytest.raises(RuntimeError, match=r"llama.cpp died by SIGILL generating from model.gguf .*GGML_NATIVE=OFF"):
        made.llama_cpp_timed(gguf, [1, 2, 3], 4, 1)
    monkeypatch.setattr(made, "TIMED_CHILD", "raise SystemExit('no such model: ' + __import__('sys').argv[1])\n")
    with pytest.raises(RuntimeError, match=r"llama.cpp failed generating from model.gguf: no such model: .*model.gguf"):
        made.llama_cpp_timed(gguf, [1, 2, 3], 4, 1)
    monkeypatch.setattr(made, "TIMED_CHILD", "import json, sys\nprint('log line')\nprint(json.dumps([0.5, 2.0, 3]))\n")
    assert made.llama_cpp_timed(gguf, [1, 2, 3], 4, 1) == (0.5, 2.0, 3)


def test_og_engine_streams_on_a_tiny_genai_build(tiny_checkpoints, tmp_path):
    """bench_sizes.py's --streams against onnxruntime-genai: its builder's CPU graph of the tiny Llama, served
    by og.Engine with the batch set to the streams; every request gets exactly its tokens."""
    made, concurrent = script_module("sized_builds"), script_module("sized_streams")
    build = made.genai_build(tiny_checkpoints["llama"], "fp32", tmp_path, threads=1)
    prompts = [[1, 40 + i, 50, 60, 70 + i] for i in range(5)]
    got = concurrent.genai_streams(build["dir"], prompts, new=6, streams=3)
    assert got["tokens"] == 5 * 6 and got["tok_s"] > 0
    assert 0 < got["itl_p50_s"] <= got["itl_p99_s"] and 0 < got["ttft_p50_s"] <= got["ttft_p99_s"]
    config = json.loads((build["dir"] / "genai_config.json").read_text())
    assert config["engine"] == {"static_batching": {"max_batch_size": 3}}
    # batch-1 decode's count: the first token comes from the prompt's run, so 6 new tokens are 5 runs after it
    first, total, after = script_module("bench_attention").genai_timed(build["dir"], prompts[0], 1, 6)
    assert after == 5 and 0 < first < total
