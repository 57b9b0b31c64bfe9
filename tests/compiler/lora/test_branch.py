"""The flat-slot branch (compiler/lora/graph.py) on a small graph of its own against the PyTorch reference
(reference.py): random stacks of any slot count and rank, tokens in any slot or none; stack_slots' layout for a
fused site, where each PEFT module's delta must land in its own output columns and nowhere else; and the branch's
shape: four nodes a site, no reshape, transpose or batched MatMul."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

IN, Q, KV = 16, 16, 8  # a q/k/v projection: 16 -> 16 + 8 + 8


def _graph(tokens_dim="num_tokens"):
    """x [1, N, IN] -> MatMul W (fused q/k/v, [IN, Q + 2 KV]) -> y; -> MatMul W2 [Q + 2 KV, IN] -> z: two sites,
    the second reading the first's output (so the branch must come before z's MatMul)."""
    from llmc.compiler.lora import Member, Site

    rng = np.random.default_rng(0)
    w, w2 = rng.normal(size=(IN, Q + 2 * KV)).astype(np.float32), rng.normal(size=(Q + 2 * KV, IN)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"], name="qkv"),
             helper.make_node("MatMul", ["y", "w2"], ["z"], name="o")]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [tokens_dim]),
                     helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, tokens_dim, IN])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, tokens_dim, IN]),
         helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, tokens_dim, Q + 2 * KV])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(w2, "w2")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    sites = [Site("qkv.0", "x", "y", IN, Q + 2 * KV, (Member("q_proj", 0, Q), Member("k_proj", Q, KV),
                                                       Member("v_proj", Q + KV, KV))),
             Site("layers.0.o_proj", "y", "z", Q + 2 * KV, IN, (Member("o_proj", 0, IN),))]
    return model, sites, w, w2


def _session(model):
    import onnxruntime as ort

    onnx.checker.check_model(model, full_check=True)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _base_y(x):
    """y of the graph without branches, as ONNX Runtime computes it: what a token in no slot must get bit for bit
    (numpy's `x @ w` may sum in another order: it differs in the last bit on AVX2-only CPUs)."""
    y, = _session(_graph()[0]).run(["y"], {"input_ids": np.zeros(x.shape[1], np.int64), "x": x})
    return y[0]


@pytest.mark.parametrize("slots_count, rank", [(1, 1), (3, 4), (5, 2)])
def test_branch_equals_the_reference(slots_count, rank):
    from llmc.compiler.lora import a_name, add_lora_branches, b_name, slot_masks
    from llmc.compiler.lora.reference import lora_delta

    model, sites, w, w2 = _graph()
    add_lora_branches(model, sites)
    session = _session(model)
    rng = np.random.default_rng(slots_count)
    n = 11
    x = rng.normal(size=(1, n, IN)).astype(np.float32)
    slots = rng.integers(-1, slots_count, size=n).astype(np.int64)
    slots[:2] = [-1, slots_count - 1]  # a token with none, and one in the last slot
    feeds = {"input_ids": np.zeros(n, np.int64), "x": x, **slot_masks(sites, slots, slots_count, rank)}
    for site in sites:
        width = slots_count * rank * len(site.members)
        feeds[a_name(site)] = rng.normal(size=(site.in_features, width)).astype(np.float32)
        feeds[b_name(site)] = rng.normal(size=(width, site.out_features)).astype(np.float32)
    z, y = session.run(["z", "y"], feeds)

    t = {k: torch.from_numpy(v) for k, v in feeds.items()}
    q, k = sites
    s = torch.from_numpy(slots)
    want_y = x[0] @ w + lora_delta(t["x"][0], s, t[a_name(q)], t[b_name(q)], slots_count).numpy()
    want_z = want_y @ w2 + lora_delta(torch.from_numpy(want_y), s, t[a_name(k)], t[b_name(k)], slots_count).numpy()
    assert np.allclose(y[0], want_y, rtol=1e-5, atol=1e-4) and np.allclose(z[0], want_z, rtol=1e-5, atol=1e-3)
    none = slots == -1
    assert np.array_equal(y[0][none], _base_y(x)[none])  # no slot: exactly the base projection's output
    assert np.abs(y[0][~none] - (x[0] @ w)[~none]).max() > 1.0


def test_a_site_is_four_nodes():
    """Each site's branch is MatMul (shrink), Mul (the mask), MatMul (expand), Add, reading the site's x and its
    flat stacks, and the pass adds no other node: a layout change that brings back reshapes, a transpose copy or a
    batched MatMul fails here."""
    from llmc.compiler.lora import a_name, add_lora_branches, b_name
    from llmc.compiler.lora.graph import BRANCH_OPS
    from llmc.runtime.lora.sites import mask_name

    model, sites, _, _ = _graph()
    before = len(model.graph.node)
    add_lora_branches(model, sites)
    assert len(model.graph.node) == before + 4 * len(sites) and BRANCH_OPS == ("MatMul", "Mul", "MatMul", "Add")
    for site in sites:
        nodes = [n for n in model.graph.node if n.name.startswith(f"lora/{site.name}/")]
        assert [n.op_type for n in nodes] == list(BRANCH_OPS), site.name
        shrink, mask, expand, add = nodes
        assert list(shrink.input) == [site.x, a_name(site)] and list(expand.input)[1] == b_name(site)
        assert list(mask.input)[1] == mask_name(len(site.members)) and list(add.output) == [site.y]
    shapes = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    assert shapes["lora.qkv.0.a"] == [IN, "lora_cols_x3"] and shapes["lora.qkv.0.b"] == ["lora_cols_x3", Q + 2 * KV]
    assert shapes["lora_mask"] == ["num_tokens", "lora_cols"]
    assert shapes["lora_mask_x3"] == ["num_tokens", "lora_cols_x3"]


def test_fused_site_keeps_each_module_in_its_columns():
    """A slot holding only k_proj's pair (rank 3 under stacks of rank 5): q's and v's columns get exactly
    nothing, k's get scaling * x A^T B^T; another slot's q_proj pair lands in q's columns only."""
    from llmc.compiler.lora import Adapter, ModuleLora, add_lora_branches, step_inputs

    model, sites, _, _ = _graph()
    add_lora_branches(model, sites)
    rng = np.random.default_rng(1)

    def pair(module, r, out):
        return ModuleLora(module, rng.normal(size=(r, IN)).astype(np.float32),
                          rng.normal(size=(out, r)).astype(np.float32), 0.75)

    only_k = Adapter("k", None, "0", {"k_proj": pair("k_proj", 3, KV)})
    only_q = Adapter("q", None, "1", {"q_proj": pair("q_proj", 5, Q)})
    feeds = step_inputs(sites, [only_k, only_q], [(2, 0), (1, 1), (1, -1)])
    assert feeds["lora.qkv.0.a"].shape == (IN, 2 * 3 * 5) and feeds["lora.qkv.0.b"].shape == (30, Q + 2 * KV)
    assert feeds["lora_mask_x3"].tolist() == [[1.0] * 15 + [0.0] * 15] * 2 + [[0.0] * 15 + [1.0] * 15, [0.0] * 30]
    x = rng.normal(size=(1, 4, IN)).astype(np.float32)
    y, = _session(model).run(["y"], {"input_ids": np.zeros(4, np.int64), "x": x, **feeds})
    delta = y[0] - _base_y(x)  # exactly 0 where no pair lands
    k, q = only_k.modules["k_proj"], only_q.modules["q_proj"]
    assert not delta[:2, :Q].any() and not delta[:2, Q + KV:].any()
    assert np.allclose(delta[:2, Q:Q + KV], 0.75 * x[0, :2] @ k.a.T @ k.b.T, atol=1e-4)
    assert np.allclose(delta[2, :Q], 0.75 * x[0, 2] @ q.a.T @ q.b.T, atol=1e-4) and not delta[2, Q:].any()
    assert not delta[3].any()


def test_refusals():
    from llmc.compiler.lora import Adapter, ModuleLora, Site, add_lora_branches, stack_slots

    model, sites, _, _ = _graph()
    with pytest.raises(ValueError, match="no sites"):
        add_lora_branches(model, [])
    with pytest.raises(ValueError, match="no tensor nowhere"):
        add_lora_branches(model, [Site("s", "x", "nowhere", IN, IN, ())])
    add_lora_branches(model, sites)
    with pytest.raises(ValueError, match="ran on it before"):
        add_lora_branches(model, sites)
    with pytest.raises(ValueError, match="at least one slot"):
        stack_slots(sites, [])
    stray = Adapter("x", None, "0", {"gate_proj": ModuleLora("gate_proj", np.zeros((2, IN)), np.zeros((IN, 2)), 1.0)})
    with pytest.raises(ValueError, match="no site computes gate_proj"):
        stack_slots(sites, [stray])
