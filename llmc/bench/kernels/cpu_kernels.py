"""llmc's 4-bit CPU kernel against ONNX Runtime's MatMulNBits, on a model's linear layers:

    .venv/bin/python -m llmc.bench cpu-kernels [--shape smollm2] [--block 32] [--threads 2] [--rows 1,4,128,512]
        [--repeats 7] [--fp32]

One graph of every 4-bit linear layer of SmolLM2-135M (30 layers of q/k/v/o, the merged gate/up and down
projections, and the LM head: 181 MatMulNBits nodes, ~75 MB of random 4-bit weights, more than most CPUs' caches, as
in a decode step, though a 300 MB L3 holds them), each node reading the same activations; `--shape llama-3.2-1b`:
Llama-3.2-1B's (16 layers, 97 nodes, ~0.7 GB), which a decode step streams from memory on any CPU. `--block`:
weights a scale and zero point (32, 64 or 128; K a multiple of it: SmolLM2's 576 is not of 128), the same for both
kernels. It runs on ONNX Runtime's kernel (MLAS) and on llmc's kernel for every instruction set this CPU has, in
turns, and prints milliseconds per run (medians) and each kernel's speedup over MLAS measured in the same run;
`--fp32` adds the same layers unquantized (ONNX Runtime's MatMul), the step a 4-bit kernel must beat.
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

# (hidden, intermediate, layers, vocabulary, KV width): the models' exact linear shapes
SHAPES = {"smollm2": (576, 1536, 30, 49152, 192), "llama-3.2-1b": (2048, 8192, 16, 128256, 512)}


def layer_stack(fp32: bool = False, shape: str = "smollm2", block: int = 32) -> onnx.ModelProto:
    """The shape's linear layers as MatMulNBits nodes in blocks of `block`, or (`fp32`) as MatMul over float32
    weights: the unquantized model's step, which a 4-bit kernel must beat at every row count."""
    hidden, intermediate, layers, vocab, kv = SHAPES[shape]
    layer_shapes = [("q", hidden, hidden), ("k", hidden, kv), ("v", hidden, kv), ("o", hidden, hidden),
                    ("gate_up", hidden, 2 * intermediate), ("down", intermediate, hidden)]
    rng = np.random.default_rng(0)
    nodes, inits, outputs = [], [], []
    shapes = [(f"{name}{layer}", k, n) for layer in range(layers) for name, k, n in layer_shapes]
    for name, k, n in [*shapes, ("lm_head", hidden, vocab)]:
        source = "x_down" if k == intermediate else "x"
        outputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, ["rows", n]))
        if fp32:
            inits.append(numpy_helper.from_array(rng.standard_normal((k, n), dtype=np.float32) * 0.02, f"{name}.W"))
            nodes.append(helper.make_node("MatMul", [source, f"{name}.W"], [name]))
            continue
        blocks = k // block
        scales = ((rng.random(n * blocks, dtype=np.float32) + 0.1) * 0.02).astype(np.float16).astype(np.float32)
        inits += [numpy_helper.from_array(rng.integers(0, 256, (n, blocks, block // 2), dtype=np.uint8), f"{name}.B"),
                  numpy_helper.from_array(scales, f"{name}.scales"),  # fp16 values, as llmc's quantizer writes
                  numpy_helper.from_array(rng.integers(0, 256, n * ((blocks + 1) // 2), dtype=np.uint8), f"{name}.zp")]
        nodes.append(helper.make_node("MatMulNBits", [source, f"{name}.B", f"{name}.scales", f"{name}.zp"], [name],
                                      domain="com.microsoft", K=k, N=n, bits=4, block_size=block, accuracy_level=4))
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", hidden]),
              helper.make_tensor_value_info("x_down", TensorProto.FLOAT, ["rows", intermediate])]
    graph = helper.make_graph(nodes, f"{shape}_linear_layers", inputs, outputs, inits)
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
    parser.add_argument("--shape", choices=tuple(SHAPES), default="smollm2",
                        help="whose linear layers (default smollm2)")
    parser.add_argument("--block", type=int, choices=(32, 64, 128), default=32,
                        help="weights a scale and zero point (default 32)")
    parser.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads (default 2)")
    parser.add_argument("--rows", default="1,4,128,512", help="activation rows to time (default 1,4,128,512)")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per kernel and row count, in turns")
    parser.add_argument("--fp32", action="store_true",
                        help="also time the same layers unquantized (MatMul over float32 weights, ~540 MB)")


def run(args: argparse.Namespace) -> None:
    kernels = cpu_kernels.load()
    if kernels is None:
        sys.exit("llmc's CPU kernel is not available here (see the log): nothing to compare")
    hidden, intermediate, *_ = SHAPES[args.shape]
    if hidden % args.block or intermediate % args.block:
        sys.exit(f"--block {args.block}: {args.shape}'s widths {hidden} and {intermediate} are not multiples of it")
    model = layer_stack(shape=args.shape, block=args.block)
    sessions = {"onnxruntime": session(model, args.threads, None)}
    sessions.update({f"llmc {isa}": session(model, args.threads, isa) for isa in kernels.isas})
    if args.fp32:
        sessions["fp32 MatMul"] = session(layer_stack(fp32=True, shape=args.shape), args.threads, None)
    print(f"{args.shape}'s {len(model.graph.node)} 4-bit linear layers in blocks of {args.block}, {args.threads} "
          f"threads, medians of {args.repeats} runs (ms)")
    print(f"{'rows':>6} " + " ".join(f"{name:>18}" for name in sessions))
    rng = np.random.default_rng(1)
    for rows in (int(r) for r in args.rows.split(",")):
        feeds = {"x": rng.standard_normal((rows, hidden), dtype=np.float32),
                 "x_down": rng.standard_normal((rows, intermediate), dtype=np.float32)}
        runs = {name: [] for name in sessions}
        for _ in range(3):  # kernels in turns, so a busy moment on the host falls on all of them
            for name, sess in sessions.items():
                runs[name].append(timed(sess, feeds, max(1, args.repeats // 3)))
        ms = medians(runs)
        base = ms["onnxruntime"]
        print(f"{rows:>6} " + " ".join(f"{value:9.2f} ({base / value:4.2f}x)" for value in ms.values()))
