"""llmc's 4-bit CPU kernel against ONNX Runtime's MatMulNBits, on SmolLM2's linear layers:

    .venv/bin/python -m llmc.bench cpu-kernels [--threads 2] [--rows 1,4,128,512] [--repeats 7] [--fp32]

One graph of every 4-bit linear layer of SmolLM2-135M (30 layers of q/k/v/o, the merged gate/up and
down projections, and the LM head: 151 MatMulNBits nodes, ~75 MB of random 4-bit weights, more than
most CPUs' caches, as in a decode step, though a 300 MB L3 holds them), each node reading the same
activations. It runs on ONNX Runtime's kernel (MLAS) and on llmc's kernel for every instruction set
this CPU has, in turns, and prints milliseconds per run (medians) and each kernel's speedup over MLAS
measured in the same run; `--fp32` adds the same layers unquantized (ONNX Runtime's MatMul), the step a 4-bit kernel must beat.
Rows 1-19 take the decode path (over 4 rows in turns over chunks of columns), 20 and more the prefill path.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from llmc.bench.harness import median, medians
from llmc.runtime.kernels import cpu_kernels, graph_edits

HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 576, 1536, 30, 49152
LAYER_SHAPES = [("q", HIDDEN, 576), ("k", HIDDEN, 192), ("v", HIDDEN, 192), ("o", HIDDEN, 576),
                ("gate_up", HIDDEN, 2 * INTERMEDIATE), ("down", INTERMEDIATE, HIDDEN)]


def layer_stack(fp32: bool = False) -> onnx.ModelProto:
    """The 151 layers as MatMulNBits nodes, or (`fp32`) as MatMul over float32 weights: the unquantized model's
    step, which a 4-bit kernel must beat at every row count."""
    rng = np.random.default_rng(0)
    nodes, inits, outputs = [], [], []
    shapes = [(f"{name}{layer}", k, n) for layer in range(LAYERS) for name, k, n in LAYER_SHAPES]
    for name, k, n in [*shapes, ("lm_head", HIDDEN, VOCAB)]:
        source = "x_down" if k == INTERMEDIATE else "x"
        outputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, ["rows", n]))
        if fp32:
            inits.append(numpy_helper.from_array(rng.standard_normal((k, n), dtype=np.float32) * 0.02, f"{name}.W"))
            nodes.append(helper.make_node("MatMul", [source, f"{name}.W"], [name]))
            continue
        blocks = k // 32
        inits += [numpy_helper.from_array(rng.integers(0, 256, (n, blocks, 16), dtype=np.uint8), f"{name}.B"),
                  numpy_helper.from_array((rng.random(n * blocks, dtype=np.float32) + 0.1) * 0.02, f"{name}.scales"),
                  numpy_helper.from_array(rng.integers(0, 256, n * blocks // 2, dtype=np.uint8), f"{name}.zp")]
        nodes.append(helper.make_node("MatMulNBits", [source, f"{name}.B", f"{name}.scales", f"{name}.zp"], [name],
                                      domain="com.microsoft", K=k, N=n, bits=4, block_size=32, accuracy_level=4))
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", HIDDEN]),
              helper.make_tensor_value_info("x_down", TensorProto.FLOAT, ["rows", INTERMEDIATE])]
    graph = helper.make_graph(nodes, "smollm2_linear_layers", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])


def session(model: onnx.ModelProto, threads: int, isa: str | None) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    if isa is not None:
        model = onnx.ModelProto.FromString(model.SerializeToString())
        graph_edits.accelerate(model, threads, isa)
        options.register_custom_ops_library(str(cpu_kernels.library()))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def timed(sess: ort.InferenceSession, feeds: dict, repeats: int) -> float:
    """Median milliseconds of `repeats` runs after one warm-up run."""
    sess.run(None, feeds)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        sess.run(None, feeds)
        times.append((time.perf_counter() - start) * 1e3)
    return median(times)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads (default 2)")
    parser.add_argument("--rows", default="1,4,128,512", help="activation rows to time (default 1,4,128,512)")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per kernel and row count, in turns")
    parser.add_argument("--fp32", action="store_true",
                        help="also time the same layers unquantized (MatMul over float32 weights, ~540 MB)")


def run(args: argparse.Namespace) -> None:
    kernels = cpu_kernels.load()
    if kernels is None:
        sys.exit("llmc's CPU kernel is not available here (see the log): nothing to compare")
    model = layer_stack()
    sessions = {"onnxruntime": session(model, args.threads, None)}
    sessions.update({f"llmc {isa}": session(model, args.threads, isa) for isa in kernels.isas})
    if args.fp32:
        sessions["fp32 MatMul"] = session(layer_stack(fp32=True), args.threads, None)
    print(f"SmolLM2's 151 4-bit linear layers, {args.threads} threads, medians of {args.repeats} runs (ms)")
    print(f"{'rows':>6} " + " ".join(f"{name:>18}" for name in sessions))
    rng = np.random.default_rng(1)
    for rows in (int(r) for r in args.rows.split(",")):
        feeds = {"x": rng.standard_normal((rows, HIDDEN), dtype=np.float32),
                 "x_down": rng.standard_normal((rows, INTERMEDIATE), dtype=np.float32)}
        runs = {name: [] for name in sessions}
        for _ in range(3):  # kernels in turns, so a busy moment on the host falls on all of them
            for name, sess in sessions.items():
                runs[name].append(timed(sess, feeds, max(1, args.repeats // 3)))
        ms = medians(runs)
        base = ms["onnxruntime"]
        print(f"{rows:>6} " + " ".join(f"{value:9.2f} ({base / value:4.2f}x)" for value in ms.values()))
