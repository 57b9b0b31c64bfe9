"""Mixture-of-experts speed on CPU, every ratio measured within one run:

    .venv/bin/python -m llmc.bench moe [--modes fp32,int4] [--passes 3] [--threads 2] [--new-tokens 32]
        [--peers llama.cpp] [--out build/bench/moe] [--hidden 1024] [--layers 6] [--skip-models]

Two random-weight checkpoints, written once under OUT/checkpoints/ (checkpoints.py's writer):
  - `moe-16x2`: a Mixtral with 16 experts, top-2, hidden 1024, experts 1024 wide, 6 layers: 0.37B
    parameters, 0.10B active per token, so the experts (1.2 GB at fp32) leave every cache;
  - `dense-active`: the same model with one dense MLP as wide as the two routed experts together
    (intermediate 2048): the same active parameter count.

1. Batch-1 decode (greedy, `--new-tokens` after a 128-token prompt, a new prompt a pass) of llmc builds of
   both at each mode (builds.py and peers.py: AWQ, searched codes and the quality report included), in passes
   with the order rotating: the mixture's step time over the dense model's (target: at most 1.3x).
2. The expert op alone at 16 rows: one MoE node of the mixture's layer shape (fp32 `MoE`, and int4 `QMoE`
   from llmc's expert quantizer), its 16 rows routed to exactly n distinct experts (n = 2, 4, 8, 16; rows x
   top-k is 32 throughout), then 1 to 16 rows all routed to the same 2 experts: step time follows the
   distinct experts, not rows x top-k.
3. llama.cpp on the same mixture (F32 and Q4_0, converted from the same checkpoint), batch-1 decode in the
   same passes, where llama-cpp-python and its converter are installed (LLAMA_CPP_CONVERT names it).
Writes OUT/moe.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from llmc.bench import checkpoints
from llmc.bench.builds import BENCH, MODES
from llmc.bench.harness import UsageError, in_turn, median, median_ratio, prompt_for, write_json
from llmc.bench.peers import PEERS

OUT = BENCH / "moe"
COMMON = {"hidden_size": 1024, "num_hidden_layers": 6, "num_attention_heads": 16, "num_key_value_heads": 4,
          "vocab_size": 49152, "max_position_embeddings": 4096, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
          "tie_word_embeddings": True, "hidden_act": "silu"}
PASSES = 15  # session runs per point of the op's curve
SHAPES = {
    "moe-16x2": {"model_type": "mixtral", **COMMON, "intermediate_size": 1024, "num_local_experts": 16,
                 "num_experts_per_tok": 2},
    "dense-active": {"model_type": "mistral", **COMMON, "intermediate_size": 2048},
}


def op_curve(threads: int, bits: int | None, hidden: int) -> dict:
    """The expert op alone (the mixture's layer shape: 16 experts `hidden` wide, top-2) at 16 rows over n
    distinct experts, and at 1-16 rows over the same 2: {label: ms}."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from llmc.compiler.quantize.experts import quantize_experts
    from llmc.plugins.op.moe import attributes

    from llmc.bench.kernels.cpu_kernels import timed  # median ms of session runs after a warm-up
    E, H, I, K = 16, hidden, hidden, 2
    rng = np.random.default_rng(0)
    fc1 = (rng.standard_normal((E, 2 * I, H)) * 0.02).astype(np.float32)
    fc2 = (rng.standard_normal((E, H, I)) * 0.02).astype(np.float32)
    node = helper.make_node("MoE", ["x", "logits", "fc1", "", "fc2"], ["y"], domain="com.microsoft",
                            **attributes(K, True, 1.0, 0.0, 0.0))
    graph = helper.make_graph([node], "moe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", H]),
                                              helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["T", E])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", H])],
                              [numpy_helper.from_array(fc1, "fc1"), numpy_helper.from_array(fc2, "fc2")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    if bits is not None:
        quantize_experts(model, bits, 32, symmetric=False, stats=None)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])

    def routed(rows: int, distinct: int) -> np.ndarray:
        """Router logits sending `rows` rows to exactly `distinct` experts, top-2 each."""
        logits = np.full((rows, E), -10.0, dtype=np.float32)
        for r in range(rows):
            logits[r, (2 * r) % distinct] = 5.0
            logits[r, (2 * r + 1) % distinct] = 4.0
        return logits

    x = rng.standard_normal((16, H)).astype(np.float32)
    curve = {}
    for distinct in (2, 4, 8, 16):
        logits = routed(16, distinct)
        curve[f"16 rows, {distinct} experts"] = timed(session, {"x": x, "logits": logits}, PASSES)
    for rows in (1, 4, 16):
        logits = routed(rows, 2)
        curve[f"{rows} rows, 2 experts"] = timed(session, {"x": x[:rows], "logits": logits}, PASSES)
    return curve


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--modes", default="fp32,int4", help="comma-separated: fp32, int8, int4")
    p.add_argument("--peers", default="llama.cpp", help="llama.cpp or none")
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--hidden", type=int, default=1024, help="hidden size and expert width (default 1024)")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--skip-models", action="store_true", help="the op curve only (no checkpoints or builds)")


def run(args: argparse.Namespace) -> None:
    modes = [m for m in args.modes.split(",") if m]
    if bad := [m for m in modes if m not in MODES]:
        raise UsageError(f"--modes: unknown {bad}; known: {', '.join(MODES)}")

    import torch
    from tokenizers import Tokenizer

    torch.set_num_threads(args.threads)
    results: dict = {"threads": args.threads, "op": {}}
    for bits in (None, 4):
        label = "fp32" if bits is None else f"int{bits}"
        results["op"][label] = op_curve(args.threads, bits, args.hidden)
        for name, ms in results["op"][label].items():
            print(f"op {label:5} {name:22} {ms:7.2f} ms", file=sys.stderr)
    if not args.skip_models:
        results["decode"] = decode_passes(args, modes, Tokenizer)
    write_json(args.out / "moe.json", results)
    print(json.dumps({k: v for k, v in results.items() if k != "decode"} | {
        "decode": {m: d.get("summary") for m, d in results.get("decode", {}).items()}}, indent=2, default=str))


def decode_passes(args, modes, Tokenizer) -> dict:
    no_llama_cpp = PEERS["llama.cpp"].missing() if "llama.cpp" in args.peers else "not asked for (--peers)"
    if no_llama_cpp:
        print(f"llama.cpp: not measured: {no_llama_cpp}", file=sys.stderr)
    sizes = {"hidden_size": args.hidden, "num_hidden_layers": args.layers}
    widths = {"moe-16x2": args.hidden, "dense-active": 2 * args.hidden}
    sized = {name: checkpoints.checkpoint(f"{name}-h{args.hidden}-l{args.layers}", args.out / "checkpoints",
                                    {**fields, **sizes, "intermediate_size": widths[name]})
                   for name, fields in SHAPES.items()}
    tokenizer = Tokenizer.from_file(str(sized["moe-16x2"] / "tokenizer.json"))
    out = {}
    for mode in modes:
        builds = {}
        for name, checkpoint in sized.items():
            print(f"{name} {mode}: building ...", file=sys.stderr)
            builds[("llmc", name)] = PEERS["llmc"].build(checkpoint, mode, args.out / name, args.threads)
        if not no_llama_cpp and mode != "int8":
            builds[("llama.cpp", "moe-16x2")] = PEERS["llama.cpp"].build(sized["moe-16x2"], mode,
                                                                         args.out / "moe-16x2", args.threads)
        passes: dict = {key: [] for key in builds}
        for n in range(args.passes):
            prompt = prompt_for(tokenizer, 128, 1000 + n)[1]
            for key in in_turn(builds, n):
                ttft, total, after = PEERS[key[0]].timed(builds[key], prompt, args.new_tokens, args.threads)
                passes[key].append(after / (total - ttft))
                print(f"  pass {n + 1} {mode} {key[0]:9} {key[1]:12} decode {passes[key][-1]:6.1f} tok/s", file=sys.stderr)
        moe, dense = passes[("llmc", "moe-16x2")], passes[("llmc", "dense-active")]
        summary = {"moe_tok_s": median(moe), "dense_tok_s": median(dense),
                   "step_ratio_moe_over_dense": median_ratio(dense, moe)}
        if ("llama.cpp", "moe-16x2") in passes:
            theirs = passes[("llama.cpp", "moe-16x2")]
            summary |= {"llama_cpp_tok_s": median(theirs), "llmc_over_llama_cpp": median_ratio(moe, theirs)}
        out[mode] = {"passes": {f"{k[0]} {k[1]}": v for k, v in passes.items()},
                     "builds": {f"{k[0]} {k[1]}": {f: b[f] for f in ("build_s", "peak_bytes") if f in b}
                                for k, b in builds.items()}, "summary": summary}
        print(f"{mode}: {summary}", file=sys.stderr)
    return out
