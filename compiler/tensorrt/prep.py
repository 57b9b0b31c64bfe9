"""The ONNX a TensorRT engine is built from: the export (plugin or reference attention) or its Q/DQ
form, in the spec's precision.

TensorRT 11 builds strongly typed networks only (no precision flags), so the types must already be
in the graph: fp16/bf16 come from NVIDIA ModelOpt's AutoCast (`convert_to_f16`, the variant that
does not run the graph — ONNX Runtime cannot run the plugin node), with normalizations kept in fp32
for their reductions. The KV-cache inputs and outputs take the low precision too (that is where the
memory is). AutoCast gives each reader of a shared constant its own copy; they are deduplicated
again. The result passes `onnx.checker` and, for Q/DQ graphs, the TensorRT Q/DQ rules (tested).

A tensor-parallel rank's graph has its `llmc.AllReduce` / `llmc.AllGather` nodes rewritten first to TensorRT's
own `DistCollective` op (plugins/trt/collective_node.py), which the ONNX parser imports as IDistCollectiveLayers;
AutoCast then types them like any other node (an fp16 network sums fp16 partials over NCCL).

Last, after the casts (they are fp32 and int32 whatever the precision), the attention plugin nodes take the key-split
workspace and counters, engine inputs threaded through every node (split_kv.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from llmc.compiler.graph.files import ONNX_NAME, load_graph, save_model
from llmc.compiler.graph.passes import deduplicate_initializers
from llmc.compiler.lora.graph import add_lora_branches
from llmc.compiler.tensorrt.split_kv import PLUGIN_OPS, SplitBuffers, add_split_buffers
from llmc.plugins.op.lowering import register_schemas
from llmc.plugins.trt import collective_node
from llmc.runtime.lora.sites import Site

FP32_OPS = ["RMSNormalization", "LayerNormalization", "SimplifiedLayerNormalization"]


def prepare_for_tensorrt(source: Path, precision: str, out_dir: Path, lora: Sequence[Site] | None = None,
                         split: SplitBuffers | None = None) -> Path:
    """Write `out_dir/model.onnx`: `source` in `precision` (fp32, fp16 or bf16); `lora`: the sites of the spec's
    adapters, whose branch (compiler/lora/graph.py) goes in first, so the engine takes the LoRA inputs (its stacks and
    masks cast with the rest: in the low precision); `split`: the attention plugins' key-split buffers (split_kv.py;
    a graph with plugin nodes must have them, the plugins take them as inputs)."""
    register_schemas()  # the plugin node's types and shapes, for AutoCast's type inference
    collective_node.register_schema()
    model = load_graph(source)
    if split is None and any(node.op_type in PLUGIN_OPS for node in model.graph.node):
        raise ValueError(f"{source}: its attention plugin nodes take the key-split buffers; prepare it with `split` "
                         "(compiler/tensorrt/split_kv.py SplitBuffers)")
    collective_node.to_dist_collectives(model)  # a split model's rank: its collectives as TensorRT's op
    if lora:
        add_lora_branches(model, list(lora))
    if precision != "fp32":
        import contextlib
        import io

        from modelopt.onnx.autocast.convert import convert_to_f16

        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            model = convert_to_f16(model, precision, keep_io_types=False, op_block_list=FP32_OPS)
        model = deduplicate_initializers(model)
    if split is not None:
        add_split_buffers(model, split)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_model(model, out_dir)
    return out_dir / ONNX_NAME
