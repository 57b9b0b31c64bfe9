"""llmc.LoraDelta against the four-node LoRA branch it replaces, one site alone at SmolLM2's shapes.

Time llmc.LoraDelta (runtime/kernels/lora_delta/) against the four-node LoRA branch it replaces (compiler/lora/
graph.py: MatMul, Mul, MatMul, Add), one site alone, at SmolLM2-135M's site shapes: gate/up 576 -> 1536, o 576 -> 576,
down 1536 -> 576 and the fused q/k/v 576 -> 960 (M = 3: q 576, k and v 192 each, B block-diagonal). Each graph reads
y_base, x, the flat stacks and the mask as inputs (what the LoRA graph binds), ONNX Runtime with --threads threads;
--tokens tokens spread round robin over --slots slots of rank --rank. Medians of --runs runs, each contender's runs
interleaved with the branch's (a run of each in turn), ratios against the branch measured in the same run.

    .venv/bin/python -m llmc.bench lora-delta [--tokens 16] [--slots 4] [--rank 16] [--runs 50] [--threads 2] [--isas]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from llmc.runtime.kernels import cpu_kernels

SITES = {"gate/up 576->1536": (576, [1536]), "o 576->576": (576, [576]), "down 1536->576": (1536, [576]),
         "q/k/v 576->960 (M=3)": (576, [576, 192, 192])}


def _inputs(lead, mask_lead=("n",)):
    """`mask_lead`: the mask's dims before its width: a token's row ([n]), or a slot graph's [batch, seq]."""
    return [helper.make_tensor_value_info("y_base", TensorProto.FLOAT, [*lead, "out"]),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [*lead, "in"]),
            helper.make_tensor_value_info("a", TensorProto.FLOAT, ["in", "w"]),
            helper.make_tensor_value_info("mask", TensorProto.FLOAT, [*mask_lead, "w"]),
            helper.make_tensor_value_info("b", TensorProto.FLOAT, ["w", "out"])]


def branch_model(lead=(1, "n"), mask_lead=("n",)):
    nodes = [helper.make_node("MatMul", ["x", "a"], ["h"]), helper.make_node("Mul", ["h", "mask"], ["h_own"]),
             helper.make_node("MatMul", ["h_own", "b"], ["delta"]), helper.make_node("Add", ["y_base", "delta"], ["y"])]
    graph = helper.make_graph(nodes, "branch", _inputs(lead, mask_lead),
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [*lead, "out"])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def fused_model(threads: int, isa: str = "", lead=(1, "n"), site: str = "bench", mask_lead=("n",)):
    node = helper.make_node("LoraDelta", ["y_base", "x", "a", "mask", "b"], ["y"], domain="llmc", threads=threads,
                            isa=isa, site=site)
    graph = helper.make_graph([node], "fused", _inputs(lead, mask_lead),
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [*lead, "out"])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("llmc", 1)])


def session(model, threads: int, library) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.register_custom_ops_library(str(library))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def feeds(n_in: int, widths: list[int], tokens: int, slots: int, rank: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    m, out = len(widths), sum(widths)
    k = m * rank
    a = rng.normal(0, 0.05, (n_in, slots * k)).astype(np.float32)
    b = np.zeros((slots * k, out), np.float32)
    offsets = np.cumsum([0, *widths])
    for s in range(slots):
        for j in range(m):
            b[s * k + j * rank:s * k + (j + 1) * rank, offsets[j]:offsets[j + 1]] = rng.normal(0, 0.05, (rank, widths[j]))
    own = (np.arange(tokens) % slots)[:, None] == np.arange(slots)[None, :]
    mask = np.repeat(own.astype(np.float32), k, axis=1)
    return {"y_base": rng.normal(size=(1, tokens, out)).astype(np.float32),
            "x": rng.normal(size=(1, tokens, n_in)).astype(np.float32), "a": a, "mask": mask, "b": b}


def time_interleaved(sessions: dict, inputs: dict, runs: int) -> dict[str, float]:
    """Median ms of each session over `runs` rounds, one run of each per round (after 5 rounds of warm-up)."""
    times = {name: [] for name in sessions}
    for r in range(runs + 5):
        for name, s in sessions.items():
            start = time.perf_counter()
            s.run(None, inputs)
            if r >= 5:
                times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--isas", action="store_true", help="also each instruction set's loops, and one thread")


def run(args: argparse.Namespace) -> int:
    library = cpu_kernels.library() or cpu_kernels.paged_library()
    listing = ctypes.CDLL(str(library)).llmc_lora_delta_isas
    listing.restype = ctypes.c_char_p
    isas = listing().decode().split(",")
    print(f"{args.tokens} tokens on {args.slots} slots of rank {args.rank}, {args.threads} threads, medians of "
          f"{args.runs} runs (ms); isas here: {', '.join(isas)}")
    for label, (n_in, widths) in SITES.items():
        contenders = {"branch": session(branch_model(), args.threads, library),
                      "fused": session(fused_model(args.threads), args.threads, library)}
        if args.isas:
            contenders["fused 1 thread"] = session(fused_model(1), args.threads, library)
            contenders.update({f"fused {isa}": session(fused_model(args.threads, isa), args.threads, library)
                               for isa in isas[1:]})
        inputs = feeds(n_in, widths, args.tokens, args.slots, args.rank)
        got = time_interleaved(contenders, inputs, args.runs)
        base = got["branch"]
        cells = [f"{name} {ms:.4f} ({ms / base:.2f}x)" if name != "branch" else f"branch {ms:.4f}"
                 for name, ms in got.items()]
        print(f"{label:22s} " + " | ".join(cells))
    return 0
