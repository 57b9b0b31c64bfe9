"""`python -m llmc.bench gpu-kernels` without a GPU: its arguments, the shapes it plans (issue 55's decode and
prefill sweeps, head sizes 128 and 256), its figures from given timings (decode TB/s with fp8 rows counting fp8
bytes; prefill TFLOP/s from the causal pairs) and the JSON it writes. The GPU run itself is the `device`
machines' (tests/benchmarks/test_bench_smoke.py runs it tiny there and checks the refusal here)."""

import argparse
import json

from llmc.bench.harness import write_json
from llmc.bench.kernels.gpu import SWEEP, add_arguments, plan, report, summarize
from llmc.bench.kernels.gpu_prefill import PREFILL_SWEEP, peak_tflops, prefill_flops, summarize_prefill


def parse(*argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_the_sweeps_hold_issue_55s_shapes_at_head_sizes_128_and_256():
    decode, prefill = plan(parse("--kind", "all", "--sweep"))
    assert decode == SWEEP and prefill == PREFILL_SWEEP
    assert {d for *_, d in decode} == {d for *_, d in prefill} == {128, 256}
    assert {(t, c) for t, c, _ in prefill} == {(2048, 0), (8192, 0), (32768, 0), (2048, 2048), (2048, 8192),
                                               (2048, 32768)}
    assert {(b, c) for b, c, _ in decode} == {(32, 4096), (8, 32768), (64, 8192), (1, 131072)}


def test_one_shape_of_the_kind_asked_for():
    args = parse("--kind", "prefill", "--tokens", "8192", "--cached", "1024", "--head-dim", "256", "--dtype", "bf16")
    assert plan(args) == ([], [(8192, 1024, 256)])
    assert plan(parse()) == ([(32, 4096, 128)], [])  # the default: one decode shape, as before prefill rows


def test_prefill_flops_count_the_causal_pairs():
    assert prefill_flops(2, 0, 1, 1) == 4 * 3  # query 0 sees 1 key, query 1 sees 2
    assert prefill_flops(3, 5, 2, 4) == 4 * 2 * 4 * (3 * 5 + 6)
    assert prefill_flops(2048, 0, 32, 128) == 4 * 32 * 128 * 2048 * 2049 // 2  # ~1.1 TFLOP


def test_prefill_figures_are_tflops_shares_and_ratios_from_one_run():
    flops = 10 ** 12
    rows = summarize_prefill({"torch SDPA": 2.0, "llmc paged prefill": 4.0}, flops, "NVIDIA H200")
    assert rows["torch SDPA"]["tflops"] == 500.0 and rows["llmc paged prefill"]["tflops"] == 250.0
    assert rows["llmc paged prefill"]["vs_sdpa"] == 0.5
    assert abs(rows["torch SDPA"]["peak_share"] - 500 / 989) < 1e-12
    assert summarize_prefill({"torch SDPA": 1.0}, flops, "Some GPU")["torch SDPA"]["peak_share"] is None
    assert peak_tflops("NVIDIA H100 PCIe") == 756.0 and peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0


def test_fp8_rows_count_the_bytes_they_read():
    timings = {"torch SDPA": 1.0, "llmc paged": 1.0, "llmc paged, fp8 KV": 0.5}
    rows = summarize(timings, 10 ** 9, "NVIDIA H200", {"llmc paged, fp8 KV": 5 * 10 ** 8})
    assert rows["llmc paged"]["tb_s"] == rows["llmc paged, fp8 KV"]["tb_s"] == 1.0
    assert rows["llmc paged, fp8 KV"]["vs_sdpa"] == 2.0


def test_the_json_holds_device_peaks_decode_and_prefill_runs(tmp_path):
    args = parse("--kind", "all")
    decode = [{"shape": {"batch": 1}, "kernels": summarize({"torch SDPA": 1.0}, 10 ** 9, "NVIDIA H200")}]
    prefill = [{"shape": {"tokens": 2048, "cached": 0},
                "kernels": summarize_prefill({"torch SDPA": 1.0}, 10 ** 12, "NVIDIA H200")}]
    write_json(tmp_path / "gpu.json", report("NVIDIA H200", args, decode, prefill))
    data = json.loads((tmp_path / "gpu.json").read_text())
    assert data["device"] == "NVIDIA H200" and data["peak_tb_s"] == 4.8 and data["peak_tflops"] == 989.0
    assert data["kind"] == "all" and data["dtype"] == "fp16"
    assert data["runs"][0]["kernels"]["torch SDPA"]["tb_s"] == 1.0
    assert data["prefill"][0]["kernels"]["torch SDPA"]["tflops"] == 1000.0


def test_a_failing_kernel_is_a_row_with_its_error_and_the_others_still_run():
    import torch

    from llmc.bench.kernels.gpu_prefill import check_kernels

    def out_of_resources():
        raise RuntimeError("out of resource: shared memory, Required: 270336, Hardware limit: 232448")

    ref = torch.ones(4)
    kernels = {"good": lambda: torch.ones(4, dtype=torch.float16), "too big": out_of_resources,
               "off": lambda: torch.full((4,), 1.5)}
    failed = check_kernels(kernels, ref)
    assert list(kernels) == ["good", "off"]  # what is timed next
    assert failed == {"too big": {"error": "RuntimeError: out of resource: shared memory, Required: 270336, "
                                           "Hardware limit: 232448"}}


def test_the_json_is_written_after_every_shape_and_failures_end_the_run_named(monkeypatch, tmp_path):
    """A GPU lease's time limit may stop the sweep: the JSON holds every shape measured so far; a shape that raised
    is an entry with its error, the others run, and the run exits non-zero naming the failures."""
    import pytest
    import torch

    from llmc.bench.kernels import gpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "NVIDIA H200")
    seen = []

    def measure(args, b, c, d):
        if d == 256 and b == 32:
            raise RuntimeError("out of resource: shared memory")
        kernels = summarize({"torch SDPA": 1.0}, 10 ** 9, "NVIDIA H200")
        if b == 1:
            kernels["llmc paged one launch"] = {"error": "CompilationError: no"}
        return {"shape": {"batch": b, "context": c, "head_dim": d}, "kernels": kernels}

    def written(path, data):
        seen.append(json.loads(json.dumps(data)))
        return write_json(path, data)

    monkeypatch.setattr(gpu, "measure", measure)
    monkeypatch.setattr(gpu, "measure_prefill", lambda args, t, c, d, time_fn: {"shape": {"tokens": t}, "kernels": {}})
    monkeypatch.setattr(gpu, "write_json", written)
    args = parse("--kind", "all", "--sweep", "--out", str(tmp_path / "gpu.json"))
    with pytest.raises(SystemExit, match=r"gpu-kernels: 3 failed .*: \(1, 131072, 128\) llmc paged one launch: "
                                         r"CompilationError: no; \(32, 4096, 256\): RuntimeError: out of resource"):
        gpu.run(args)
    assert len(seen) == len(SWEEP) + len(PREFILL_SWEEP) + 1
    assert [len(s["runs"]) + len(s["prefill"]) for s in seen[:-1]] == list(range(1, len(seen)))
    assert [s["complete"] for s in seen] == [False] * (len(seen) - 1) + [True]
    final = json.loads((tmp_path / "gpu.json").read_text())
    assert final == seen[-1] and len(final["runs"]) == len(SWEEP) and len(final["prefill"]) == len(PREFILL_SWEEP)
    assert final["runs"][4] == {"shape": [32, 4096, 256], "error": "RuntimeError: out of resource: shared memory"}


def test_tuning_times_every_configuration_at_the_default_split_count_and_at_twice_it():
    from llmc.bench.kernels.gpu_tune import KERNELS, TUNE_CONFIGS, variants

    defaults = {"slot one launch": 4, "paged two launches": 2, "paged one launch": 2}
    runs = variants(defaults, 32768)
    assert len(runs) == len(KERNELS) * len(TUNE_CONFIGS) * 2
    assert {s for k, _, s in runs if k == "slot one launch"} == {4, 8}
    assert {s for k, _, s in runs if k == "paged one launch"} == {2, 4}
    assert {c.block_n for _, c, _ in runs} == {32, 64, 128} and {c.num_warps for _, c, _ in runs} == {4, 8}
    # a split never gets fewer keys than the widest configuration's step: one count at a short context
    assert {s for _, _, s in variants({k: 1 for k in KERNELS}, 128)} == {1}
    assert parse("--kind", "tune").tune_workers == 8
