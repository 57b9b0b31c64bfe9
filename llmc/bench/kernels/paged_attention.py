"""llmc's CPU PagedAttention against ONNX Runtime's GroupQueryAttention on the same attention work:

    .venv/bin/python -m llmc.bench paged-attention [--threads 2] [--layers 8] [--repeats 7]

SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head size 64, rotary in the op), two steps:
decode, 16 rows of one new token each at ~300 cached tokens (280-320, rows at different positions), and
prefill, one row's 256-token chunk with no past. Each graph is a stack of `--layers` attention nodes, each
over its own caches (so the caches stream from memory as in a model's step, not from a warm cache):
llmc.PagedAttention over block pools (blocks of 16, block tables shuffled) and
com.microsoft.GroupQueryAttention over today's contiguous slots ([rows, 3, max_seq_len 2048, 64]), both
updating their caches in place through IO binding, as the runners do. Each pass times `--iterations`
runs of each graph, in turns; the benchmark prints milliseconds per step (median over passes, and the
spread) and llmc's speedup over GQA measured in the same run (the median of the per-pass ratios).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from llmc.bench.harness import median_ratio, medians
from llmc.runtime.kernels import cpu_kernels

HEADS, KV_HEADS, D, CAPACITY, BLOCK = 9, 3, 64, 2048, 16
F, I32 = TensorProto.FLOAT, TensorProto.INT32


def graph(kind: str, layers: int, cache_shape: list[int], threads: int, isa: str):
    hidden, kv_hidden = HEADS * D, KV_HEADS * D
    shared = [("query", F, ["T", hidden] if kind == "paged" else ["B", "S", hidden]),
              ("key", F, ["T", kv_hidden] if kind == "paged" else ["B", "S", kv_hidden]),
              ("value", F, ["T", kv_hidden] if kind == "paged" else ["B", "S", kv_hidden])]
    if kind == "paged":
        shared += [("cumulative_sequence_length", I32, ["B1"]), ("past_seqlens", I32, ["B"]),
                   ("block_table", I32, ["B", "M"])]
    else:
        shared += [("seqlens_k", I32, ["B"]), ("total_sequence_length", I32, [])]
    shared += [("cos_cache", F, [CAPACITY, D // 2]), ("sin_cache", F, [CAPACITY, D // 2])]
    inputs, outputs, nodes = list(shared), [], []
    for layer in range(layers):
        k, v = f"k{layer}", f"v{layer}"
        inputs += [(k, F, cache_shape), (v, F, cache_shape)]
        outputs += [(f"out{layer}", F, None), (f"{k}_out", F, cache_shape), (f"{v}_out", F, cache_shape)]
        if kind == "paged":
            names = ["query", "key", "value", k, v, "cumulative_sequence_length", "past_seqlens", "block_table",
                     "cos_cache", "sin_cache"]
            nodes.append(helper.make_node("PagedAttention", names, [o[0] for o in outputs[-3:]], domain="llmc",
                                          num_heads=HEADS, kv_num_heads=KV_HEADS, do_rotary=1, threads=threads,
                                          isa=isa))
        else:
            names = ["query", "key", "value", k, v, "seqlens_k", "total_sequence_length", "cos_cache", "sin_cache"]
            nodes.append(helper.make_node("GroupQueryAttention", names, [o[0] for o in outputs[-3:]],
                                          domain="com.microsoft", num_heads=HEADS, kv_num_heads=KV_HEADS, do_rotary=1))
    g = helper.make_graph(nodes, kind, [helper.make_tensor_value_info(*i) for i in inputs],
                          [helper.make_tensor_value_info(*o) for o in outputs])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("llmc", 1),
                                                helper.make_opsetid("com.microsoft", 1)])
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    if kind == "paged":
        options.register_custom_ops_library(str(cpu_kernels.paged_library()))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def bound(session, feeds: dict, layers: int, cache_shape: list[int]):
    """IO binding with every cache bound as its node's input and output (updated in place)."""
    binding = session.io_binding()
    for layer in range(layers):
        binding.bind_output(f"out{layer}")
    for name, value in feeds.items():
        binding.bind_cpu_input(name, value)
    rng = np.random.default_rng(1)
    for layer in range(layers):
        for c in (f"k{layer}", f"v{layer}"):
            value = ort.OrtValue.ortvalue_from_numpy(rng.standard_normal(cache_shape, np.float32))
            binding.bind_ortvalue_input(c, value)
            binding.bind_ortvalue_output(f"{c}_out", value)
    return binding


def step_feeds(past: list[int], new: int):
    rng = np.random.default_rng(0)
    rows, tokens = len(past), len(past) * new
    angles = rng.random((CAPACITY, D // 2), np.float32) * 6
    common = {"cos_cache": np.cos(angles), "sin_cache": np.sin(angles)}
    q = rng.standard_normal((tokens, HEADS * D), np.float32)
    k, v = (rng.standard_normal((tokens, KV_HEADS * D), np.float32) for _ in range(2))
    per_row = int(-(-(max(past) + new) // BLOCK))
    table = rng.permutation(rows * per_row).reshape(rows, per_row).astype(np.int32)
    paged = {"query": q, "key": k, "value": v, "cumulative_sequence_length": np.arange(rows + 1, dtype=np.int32) * new,
             "past_seqlens": np.array(past, np.int32), "block_table": table, **common}
    gqa = {"query": q.reshape(rows, new, -1), "key": k.reshape(rows, new, -1), "value": v.reshape(rows, new, -1),
           "seqlens_k": np.array(past, np.int32) + new - 1,
           "total_sequence_length": np.array(max(past) + new, np.int32), **common}
    return paged, gqa, [int(rows * per_row), BLOCK, KV_HEADS, D], [rows, KV_HEADS, CAPACITY, D]


def measure(name: str, past: list[int], new: int, args) -> float:
    paged_feeds, gqa_feeds, paged_shape, gqa_shape = step_feeds(past, new)
    runs = {}
    for kind, feeds, shape in (("paged", paged_feeds, paged_shape), ("gqa", gqa_feeds, gqa_shape)):
        session = graph(kind, args.layers, shape, args.threads, args.isa)
        runs[kind] = (session, bound(session, feeds, args.layers, shape))
    times = {kind: [] for kind in runs}
    for _ in range(args.repeats):
        for kind, (session, binding) in runs.items():  # in turns, so drift hits both alike
            session.run_with_iobinding(binding)
            start = time.perf_counter()
            for _ in range(args.iterations):
                session.run_with_iobinding(binding)
            times[kind].append((time.perf_counter() - start) / args.iterations * 1e3)
    med = medians(times)
    for kind, t in times.items():
        print(f"  {name:<34} {kind:<6} {med[kind]:8.3f} ms/step ({args.layers} layers; passes {min(t):.3f}"
              f"-{max(t):.3f})")
    ratio = median_ratio(times["gqa"], times["paged"])
    print(f"  {name:<34} llmc PagedAttention {ratio:.2f}x GroupQueryAttention")
    return ratio


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--isa", default="", help="pin llmc's loops: avx512, avx2 or portable (default: the best)")


def run(args: argparse.Namespace) -> None:
    print(f"ONNX Runtime {ort.__version__}, {args.threads} threads; llmc PagedAttention loops: "
          f"{args.isa or cpu_kernels.paged_isas()[0]}")
    past = [int(p) for p in np.linspace(280, 320, 16)]
    measure("decode: 16 rows x 1 token, ~300 past", past, 1, args)
    measure("prefill: 1 row x 256 tokens, no past", [0], 256, args)
