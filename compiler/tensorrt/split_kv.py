"""The attention plugins' key-split buffers in the graph a TensorRT engine is built from.

A decode step at a small batch and a long context gives the attention kernel too few programs to fill a GPU (one
per row tile and KV head); its plugin kernels therefore split each tile's keys over up to `key_splits` programs and
merge their partial results in the same launch (plugins/gpu/split_kv.py). The merge needs a workspace for the
partials and per-tile counters that start at zero and persist from one launch to the next, which an ahead-of-time
TensorRT plugin cannot get from TensorRT (it has no workspace and no enqueue of its own). So the engine takes them
as two inputs of a fixed size:

    attention_split_partials  fp32 [slots x BLOCK_M x (head_dim + 2)]   the partials of `slots` programs
    attention_split_counters  int32 [slots]                             one per tile, zero between launches

threaded through every plugin node in graph order (node i's aliased outputs are node i + 1's inputs, so TensorRT
sees each buffer written by one layer at a time) and returned by the last as `*_out`; the runner binds each once,
zeroed, as the input and the output (runtime/runners/trt_split.py). `slots` is 2 x the GPU's SMs: a launch's grid
takes as many of its `key_splits` as keep its partials within them (plugins/gpu/split_kv.py plugin_splits, a shape
expression), which is decode_splits' rule of about 2 programs per SM. `key_splits` is what a batch of one row at
the longest context takes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from llmc.plugins.gpu.configs import BLOCK_M, decode_splits
from llmc.plugins.op import fused_node, paged_node
from llmc.plugins.op.onnx_schema import PLUGIN_OP
from llmc.plugins.op.paged_node import PAGED_PLUGIN_OP
from llmc.runtime.runners.trt_split import SPLIT_BUFFERS, SPLIT_TYPES

PARTIALS, COUNTERS = SPLIT_BUFFERS
DEFAULT_SMS = 132  # an H100's or H200's, where no GPU says otherwise
_HEADS = {PLUGIN_OP: ("num_heads", "num_kv_heads", "head_dim"), PAGED_PLUGIN_OP: ("num_heads", "kv_num_heads",
                                                                                  "head_size")}
PLUGIN_OPS = tuple(_HEADS)  # the attention plugin nodes' op types


def build_gpu_sms() -> int:
    """The SMs of the GPU the engine is built on (PyTorch's view of device 0), or DEFAULT_SMS without one."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(0).multi_processor_count
    except ImportError:
        pass
    return DEFAULT_SMS


@dataclass(frozen=True)
class SplitBuffers:
    """The buffers for an engine of heads up to `head_dim` channels serving up to `max_seq_len` tokens a row, on a
    GPU of `num_sms` SMs."""

    max_seq_len: int
    head_dim: int
    num_sms: int = DEFAULT_SMS

    @property
    def slots(self) -> int:
        return 2 * self.num_sms

    def shapes(self) -> dict[str, tuple[int]]:
        """Each buffer's fixed shape (the engine's profiles give it as min, opt and max)."""
        return {PARTIALS: (self.slots * BLOCK_M * (self.head_dim + 2),), COUNTERS: (self.slots,)}

    def key_splits(self, num_heads: int, num_kv_heads: int) -> int:
        """The most splits a launch takes: a decode step of one row at the longest context (its row tiles: the
        query heads of a KV group, BLOCK_M to a tile)."""
        tiles = -(-(num_heads // num_kv_heads) // BLOCK_M)
        return decode_splits(tiles, num_kv_heads, self.max_seq_len, self.num_sms)


def add_split_buffers(model: onnx.ModelProto, buffers: SplitBuffers) -> int:
    """Give every attention plugin node of `model` the split buffers (inputs, aliased outputs) and its key_splits
    and split_slots, in place; returns how many nodes took them (0: no plugin node, nothing added)."""
    nodes = [n for n in model.graph.node if n.op_type in _HEADS]
    if not nodes:
        return 0
    taken = {*(i.name for i in model.graph.input), *(o.name for o in model.graph.output)}
    if taken & {*SPLIT_BUFFERS, *SPLIT_BUFFERS.values()}:
        raise ValueError(f"the graph already has split buffers ({sorted(taken & {*SPLIT_BUFFERS})}): prepared twice?")
    shapes = buffers.shapes()

    def info(name: str, buffer: str):  # the type the runner allocates (trt_split.SPLIT_TYPES)
        return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(np.dtype(SPLIT_TYPES[buffer])),
                                             shapes[buffer])

    model.graph.input.extend([info(PARTIALS, PARTIALS), info(COUNTERS, COUNTERS)])
    read = {*(i for n in model.graph.node for i in n.input), *(o.name for o in model.graph.output)}
    current = [PARTIALS, COUNTERS]
    for i, node in enumerate(nodes):
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        heads, kv_heads, head_dim = (attrs[a] for a in _HEADS[node.op_type])
        if head_dim > buffers.head_dim:
            raise ValueError(f"{node.op_type} node {node.name!r}: head size {head_dim} is wider than the split "
                             f"workspace's {buffers.head_dim}")
        if len(node.input) != len(fused_node.INPUTS if node.op_type == PLUGIN_OP else paged_node.INPUTS):
            raise ValueError(f"{node.op_type} node {node.name!r} has {len(node.input)} inputs: split buffers already "
                             "given, or not an exported plugin node")
        if read & set(node.output[3:]):  # an export names the schema's optional outputs too; nothing reads them
            raise ValueError(f"{node.op_type} node {node.name!r}: its split outputs are already read")
        last = i == len(nodes) - 1
        outputs = [SPLIT_BUFFERS[name] if last else f"{name}.{i}" for name in (PARTIALS, COUNTERS)]
        node.input.extend(current)
        del node.output[3:]
        node.output.extend(outputs)
        kept = [a for a in node.attribute if a.name not in ("key_splits", "split_slots")]  # an export's defaults
        del node.attribute[:]
        node.attribute.extend([*kept, helper.make_attribute("key_splits", buffers.key_splits(heads, kv_heads)),
                               helper.make_attribute("split_slots", buffers.slots)])
        current = outputs
    model.graph.output.extend([info(SPLIT_BUFFERS[PARTIALS], PARTIALS), info(SPLIT_BUFFERS[COUNTERS], COUNTERS)])
    return len(nodes)
