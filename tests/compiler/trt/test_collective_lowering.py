"""A split model's collectives as TensorRT's ONNX op (plugins/trt/collective_node.py): the rewritten graphs of all
ranks, run together under onnx's reference evaluator with DistCollective as TensorRT's operator reference defines
it (a gather concatenates along the first axis), compute what llmc's collectives compute (a sum; a concatenation of
the ranks' last axes in rank order); a real split export is rewritten and cast to fp16 by the TensorRT prep."""

import threading

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator  # noqa: E402  (before the schemas register: see test_paged_plugin)
from onnx.reference.op_run import OpRun

from llmc.plugins.trt import collective_node
from llmc.plugins.trt.collective_node import DIST_COLLECTIVE, collectives, dist_collectives, to_dist_collectives


class _Group:
    """The ranks of one run, each a thread: every collective call swaps the ranks' tensors at a barrier."""

    def __init__(self, world_size):
        self.barrier, self.slots, self.local = threading.Barrier(world_size), [None] * world_size, threading.local()

    def exchange(self, x):
        self.slots[self.local.rank] = x
        self.barrier.wait()
        values = list(self.slots)
        self.barrier.wait()
        return values


GROUP = None


class DistCollective(OpRun):
    op_domain = ""

    def _run(self, x, collective_operation=None, reduce_op=None, root=None, nb_rank=None, groups=None,
             group_size=None):
        assert (root, list(groups), group_size) == (-1, list(range(nb_rank)), nb_rank)
        values = GROUP.exchange(x)
        if collective_operation == "all_reduce":
            assert reduce_op == "sum"
            return (np.sum(values, axis=0).astype(x.dtype),)
        assert collective_operation == "all_gather" and reduce_op == "none"
        return (np.concatenate(values, axis=0),)  # TensorRT's ALL_GATHER: along the first dimension


def _rank_graph(rank, world_size, shape):
    """y = AllReduce(x), z = AllGather(x) over the last axis, as plugins/op/collective.py lowers them."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)
    z = helper.make_tensor_value_info("z", TensorProto.FLOAT, [*shape[:-1], shape[-1] * world_size])
    nodes = [helper.make_node("Relu", ["x"], ["h"]),
             helper.make_node("AllReduce", ["h"], ["y"], domain="llmc", rank=rank, world_size=world_size),
             helper.make_node("AllGather", ["h"], ["z"], domain="llmc", rank=rank, world_size=world_size)]
    graph = helper.make_graph(nodes, "rank", [x], [y, z], value_info=[helper.make_tensor_value_info(
        "h", TensorProto.FLOAT, shape)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("llmc", 1)])


def _run_ranks(models, feeds):
    global GROUP
    GROUP = _Group(len(models))
    results, errors = [None] * len(models), []

    def run(rank):
        GROUP.local.rank = rank
        try:
            results[rank] = ReferenceEvaluator(models[rank], new_ops=[DistCollective]).run(None, {"x": feeds[rank]})
        except Exception as err:  # noqa: BLE001  (reported below)
            errors.append(err)
            GROUP.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(models))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return results


@pytest.mark.parametrize("world_size, shape", [(2, [2, 3, 4]), (3, [5, 2]), (2, [6])])
def test_rewritten_ranks_compute_llmc_collectives(world_size, shape):
    models = [_rank_graph(r, world_size, shape) for r in range(world_size)]
    for rank, model in enumerate(models):
        assert to_dist_collectives(model) == (rank, world_size, 1, 1)
        assert not [n for n in model.graph.node if n.domain == "llmc"]
        collective_node.register_schema()
        onnx.checker.check_model(onnx.shape_inference.infer_shapes(model, strict_mode=True))
    rng = np.random.default_rng(0)
    feeds = [rng.standard_normal(shape).astype(np.float32) for _ in range(world_size)]
    relu = [np.maximum(f, 0) for f in feeds]
    for y, z in _run_ranks(models, feeds):
        np.testing.assert_allclose(y, np.sum(relu, axis=0), rtol=1e-6)
        np.testing.assert_array_equal(z, np.concatenate(relu, axis=-1))  # rank order along the last axis


def test_nodes_carry_tensorrt_attributes_and_shapes_infer_like_llmc():
    model = _rank_graph(1, 4, [2, 3, 5])
    to_dist_collectives(model)
    reduce, gather = dist_collectives(model)
    assert reduce == {"collective_operation": b"all_reduce", "reduce_op": b"sum", "root": -1, "nb_rank": 4,
                      "groups": [0, 1, 2, 3], "group_size": 4}
    assert gather["collective_operation"] == b"all_gather" and gather["reduce_op"] == b"none"
    transposes = [list(n.attribute[0].ints) for n in model.graph.node if n.op_type == "Transpose"]
    assert transposes == [[2, 0, 1], [1, 2, 0]]
    collective_node.register_schema()
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    z = next(o for o in inferred.graph.output if o.name == "z")
    assert [d.dim_value for d in z.type.tensor_type.shape.dim] == [2, 3, 20]


def test_graphs_without_collectives_are_left_alone_and_inconsistent_ones_refused():
    plain = helper.make_model(helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])]))
    before = plain.SerializeToString()
    assert to_dist_collectives(plain) is None and plain.SerializeToString() == before
    mixed = _rank_graph(0, 2, [2, 4])
    mixed.graph.node[2].attribute[0].i = 1  # the gather claims another rank than the reduce
    with pytest.raises(ValueError, match=r"disagree on their rank and group: \[\(0, 2\), \(1, 2\)\]"):
        collectives(mixed)
    unshaped = _rank_graph(0, 2, [2, 4])
    del unshaped.graph.value_info[:]
    with pytest.raises(ValueError, match="AllGather node .*no shape for its input 'h'"):
        to_dist_collectives(unshaped)


@pytest.fixture(scope="module")
def split_plugin_export(tiny_checkpoints, tmp_path_factory):
    """The tiny Llama split over 2 ranks with the TensorRT plugin lowering (the graph a TensorRT split would
    prepare; the spec does not build one yet, so the export function is called directly)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmc.compiler.graph.export import export
    from llmc.plugins.op.lowering import Lowering

    path, out = tiny_checkpoints["llama"], tmp_path_factory.mktemp("tp_plugin")
    model, tokenizer = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    return export(model, tokenizer, out, lowering=Lowering.plugin, source_hash="s", inputs_hash="i", ranks=2), out


def test_a_split_plugin_export_prepares_for_tensorrt_in_fp16(split_plugin_export, tmp_path):
    from llmc.compiler.tensorrt.collectives import expected_collectives
    from llmc.compiler.tensorrt.prep import prepare_for_tensorrt
    from llmc.compiler.tensorrt.split_kv import SplitBuffers

    exported, folder = split_plugin_export
    layers, vocab = exported.model.num_layers, exported.model.vocab_size
    prepared = prepare_for_tensorrt(folder / "rank1" / "model.onnx", "fp16", tmp_path / "trt",
                                    split=SplitBuffers(64, exported.model.head_dim))
    model = onnx.load(str(prepared), load_external_data=False)
    onnx.checker.check_model(model)
    assert not [n for n in model.graph.node if n.domain == "llmc" and n.op_type in ("AllReduce", "AllGather")]
    found = expected_collectives(prepared)
    assert [c["collective_operation"] for c in found] == [b"all_reduce"] * 2 * layers + [b"all_gather"]
    assert all(c["nb_rank"] == 2 for c in found)
    types = {v.name: v.type.tensor_type.elem_type for v in [*model.graph.value_info, *model.graph.output]}
    for node in (n for n in model.graph.node if n.op_type == DIST_COLLECTIVE):
        assert types[node.input[0]] == types[node.output[0]] == TensorProto.FLOAT16  # partial sums in fp16
    logits = next(o for o in model.graph.output if o.name == "logits")
    assert logits.type.tensor_type.shape.dim[-1].dim_value == vocab  # the gathered vocabulary, padding sliced off
