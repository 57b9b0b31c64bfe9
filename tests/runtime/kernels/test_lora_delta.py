"""llmc.LoraDelta (runtime/kernels/lora_delta/) and the session-time fusion that puts it in place of each LoRA site's
four-node branch (runtime/kernels/lora_fusion.py): the op against the PyTorch reference (compiler/lora/reference.py)
and against the four-node branch on ONNX Runtime, on random stacks laid out as the runtime binds them (mixed slots,
tokens with none, ranks padded with zeros, fused q/k/v sites with a block-diagonal B, both x ranks, every
instruction set, one and two threads); the fusion on graphs the compiler's pass wrote, alone and after the 4-bit
swap and its bias fold; the switch that turns it off."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from llmc.compiler.lora import Member, Site, add_lora_branches, slot_masks
from llmc.bench.kernels.lora_delta import branch_model, fused_model
from llmc.compiler.lora.reference import lora_delta
from llmc.runtime.kernels import cpu_kernels, lora_fusion
from llmc.runtime.lora.sites import a_name, b_name, mask_name

LIBRARY = cpu_kernels.library()
pytestmark = pytest.mark.skipif(LIBRARY is None, reason="llmc's CPU kernel library is not available here (the log)")
ISAS = ("avx512", "avx2", "portable")


def _isas() -> list[str]:
    import ctypes

    listing = ctypes.CDLL(str(LIBRARY)).llmc_lora_delta_isas
    listing.restype = ctypes.c_char_p
    return listing().decode().split(",")


def _lead(x_rank: int) -> tuple:
    return ("n",) if x_rank == 2 else (1, "n")


def _op_model(x_rank: int, threads: int, isa: str, site: str = "layers.0.q") -> onnx.ModelProto:
    return fused_model(threads, isa, _lead(x_rank), site)


def _branch_model(x_rank: int) -> onnx.ModelProto:
    """The four-node branch graph.py writes, as a graph of its own (y_base an input)."""
    return branch_model(_lead(x_rank))


def _session(model: onnx.ModelProto, threads: int = 2) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.register_custom_ops_library(str(LIBRARY))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _stacks(rng, n_in: int, widths: list[int], slots: int, rank: int, ranks: list[int]):
    """Flat stacks as runtime/lora/stacks.py lays them out: slot s's module m in columns s*M*R + m*R .. + its rank
    (`ranks[s]`, zeros beyond it: padding), B block-diagonal (module m's rows only into its own output columns)."""
    m, out = len(widths), sum(widths)
    a = np.zeros((n_in, slots * m * rank), np.float32)
    b = np.zeros((slots * m * rank, out), np.float32)
    offsets = np.cumsum([0, *widths])
    for s in range(slots):
        for j in range(m):
            c = s * m * rank + j * rank
            a[:, c:c + ranks[s]] = rng.normal(0, 0.1, (n_in, ranks[s]))
            b[c:c + ranks[s], offsets[j]:offsets[j + 1]] = rng.normal(0, 0.1, (ranks[s], widths[j]))
    return a, b


def _case(seed: int, n: int, n_in: int, widths: list[int], slots: int, rank: int, x_rank: int):
    rng = np.random.default_rng(seed)
    ranks = [rank] + list(rng.integers(1, rank + 1, slots - 1))  # the first slot at the stacks' rank, others padded
    a, b = _stacks(rng, n_in, widths, slots, rank, ranks)
    token_slots = rng.integers(-1, slots, n).astype(np.int64)
    token_slots[: min(n, 2)] = [slots - 1, -1][: min(n, 2)]  # one token in the last slot, one in none
    site = Site("s", "x", "y", n_in, sum(widths), tuple(Member(f"m{j}", 0, w) for j, w in enumerate(widths)))
    mask = slot_masks([site], token_slots, slots, rank)[mask_name(len(widths))]
    shape = (n,) if x_rank == 2 else (1, n)
    x = rng.normal(0, 1, (*shape, n_in)).astype(np.float32)
    y_base = rng.normal(0, 1, (*shape, sum(widths))).astype(np.float32)
    y_base.reshape(-1)[::7] = -0.0  # a -0 stays -0 where a token has no slot (the branch's + 0 would make it +0)
    return dict(y_base=y_base, x=x, a=a, mask=mask, b=b), token_slots


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("n, n_in, widths, slots, rank, x_rank, threads", [
    (1, 64, [48], 1, 16, 3, 1),            # one token, one slot
    (16, 96, [64, 32, 32], 4, 16, 3, 2),   # a fused q/k/v site (M = 3): 16 tokens on 4 slots
    (13, 80, [40], 3, 5, 2, 2),            # rank not a multiple of 16 (the scalar columns), out not a multiple of 16
    (37, 64, [300], 5, 8, 3, 2),           # many tokens (tiles of 8, the last one short), out in two chunks
    (9, 33, [7, 5, 5], 2, 3, 2, 1),        # odd sizes everywhere, M = 3
    (512, 512, [1024], 4, 64, 2, 2),       # work past PARALLEL_WORK (lora_delta_op.c): the passes split over threads
])
def test_op_equals_the_reference_and_the_branch(isa, n, n_in, widths, slots, rank, x_rank, threads):
    if isa not in _isas():
        pytest.skip(f"this CPU does not run {isa}")
    feeds, token_slots = _case(n * 31 + rank, n, n_in, widths, slots, rank, x_rank)
    got = _session(_op_model(x_rank, threads, isa), threads).run(None, feeds)[0]
    branch = _session(_branch_model(x_rank), threads).run(None, feeds)[0]
    t = {k: torch.from_numpy(v) for k, v in feeds.items()}
    want = feeds["y_base"].reshape(n, -1) + lora_delta(t["x"].reshape(n, n_in), torch.from_numpy(token_slots), t["a"],
                                                       t["b"], slots).numpy()
    assert got.shape == feeds["y_base"].shape
    assert np.allclose(got.reshape(n, -1), want, rtol=1e-5, atol=1e-5)
    assert np.allclose(got, branch, rtol=1e-5, atol=1e-5)
    none = token_slots == -1
    assert np.array_equal(got.reshape(n, -1)[none].view(np.uint32), feeds["y_base"].reshape(n, -1)[none].view(np.uint32))
    assert np.abs(got.reshape(n, -1)[~none] - feeds["y_base"].reshape(n, -1)[~none]).max() > 0.05


def test_mask_values_scale_and_an_all_zero_step():
    """The op multiplies by the mask's values, as the branch's Mul does (not only 1s), and a step whose tokens have
    no slot is y_base as it is."""
    feeds, _ = _case(3, 6, 32, [16], 2, 4, 3)
    feeds["mask"] = feeds["mask"] * np.float32(0.5)
    session, branch = _session(_op_model(3, 2, "")), _session(_branch_model(3))
    assert np.allclose(session.run(None, feeds)[0], branch.run(None, feeds)[0], rtol=1e-5, atol=1e-6)
    feeds["mask"][:] = 0
    assert np.array_equal(session.run(None, feeds)[0].view(np.uint32), feeds["y_base"].view(np.uint32))


def test_bad_shapes_name_the_site_and_the_input():
    feeds, _ = _case(4, 5, 32, [16], 2, 4, 3)
    session = _session(_op_model(3, 1, "", site="layers.3.mlp.down_proj"))
    with pytest.raises(Exception, match=r"llmc.LoraDelta \(site layers.3.mlp.down_proj\): B's rows are not A's columns"):
        session.run(None, {**feeds, "b": feeds["b"][:-1]})
    with pytest.raises(Exception, match=r"mask's rows are not x's tokens"):
        session.run(None, {**feeds, "mask": feeds["mask"][:-2]})
    with pytest.raises(Exception, match=r"unknown isa|isa 'sse9' is not one this CPU runs"):
        _session(_op_model(3, 1, "sse9"))


@pytest.mark.parametrize("isa", ISAS)
def test_a_slot_graphs_per_token_mask(isa):
    """A slot graph's branch (x [B, S, in], mask [B, S, W]: a row per token) as the op, the four nodes and the
    reference compute it; a mask whose leading dims are not x's is refused naming it."""
    if isa not in _isas():
        pytest.skip(f"this CPU does not run {isa}")
    batch, seq, n_in, widths, slots, rank = 3, 4, 48, [32, 16, 16], 2, 8
    feeds, token_slots = _case(7, batch * seq, n_in, widths, slots, rank, 2)
    feeds = {**feeds, "x": feeds["x"].reshape(batch, seq, n_in), "y_base": feeds["y_base"].reshape(batch, seq, -1),
             "mask": feeds["mask"].reshape(batch, seq, -1)}
    lead = ("batch", "seq")
    got = _session(fused_model(2, isa, lead, mask_lead=lead), 2).run(None, feeds)[0]
    branch = _session(branch_model(lead, mask_lead=lead)).run(None, feeds)[0]
    t = {k: torch.from_numpy(v) for k, v in feeds.items()}
    want = feeds["y_base"].reshape(batch * seq, -1) + lora_delta(
        t["x"].reshape(-1, n_in), torch.from_numpy(token_slots), t["a"], t["b"], slots).numpy()
    assert np.allclose(got.reshape(batch * seq, -1), want, rtol=1e-5, atol=1e-5)
    assert np.allclose(got, branch, rtol=1e-5, atol=1e-5)
    with pytest.raises(Exception, match=r"mask \[N, W\] or \[\.\., N, W\]"):
        _session(fused_model(1, isa, lead, mask_lead=("k", "seq"))).run(None, {**feeds, "mask": feeds["mask"][:2]})


IN, Q, KV = 64, 64, 32


def _lora_graph(int4: bool = False, bias: bool = False):
    """A graph of two projections, x -> q/k/v (fused, M = 3) -> y -> o -> z, with the compiler's LoRA pass on both.
    `int4`: the q/k/v projection a MatMulNBits (4 bits, blocks of 32, int8 activations: the 4-bit swap takes it),
    `bias`: an Add of a bias after it (fold_bias folds it into the swapped node)."""
    rng = np.random.default_rng(1)
    out = Q + 2 * KV
    w2 = rng.normal(0, 0.1, (out, IN)).astype(np.float32)
    inits = [numpy_helper.from_array(w2, "w2")]
    qkv_out = "y_nobias" if bias else "y"
    if int4:
        inits += [numpy_helper.from_array(rng.integers(0, 256, (out, IN // 32, 16), dtype=np.uint8), "wq"),
                  numpy_helper.from_array((rng.random(out * IN // 32, dtype=np.float32) + 0.1) * 0.02, "scales")]
        qkv = helper.make_node("MatMulNBits", ["x", "wq", "scales"], [qkv_out], name="qkv", domain="com.microsoft",
                               K=IN, N=out, bits=4, block_size=32, accuracy_level=4)
    else:
        inits.append(numpy_helper.from_array(rng.normal(0, 0.1, (IN, out)).astype(np.float32), "w"))
        qkv = helper.make_node("MatMul", ["x", "w"], [qkv_out], name="qkv")
    nodes = [qkv]
    if bias:
        inits.append(numpy_helper.from_array(rng.normal(0, 1, out).astype(np.float32), "bias"))
        nodes.append(helper.make_node("Add", [qkv_out, "bias"], ["y"], name="qkv_bias"))
    nodes.append(helper.make_node("MatMul", ["y", "w2"], ["z"], name="o"))
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["num_tokens"]),
                     helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "num_tokens", IN])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, "num_tokens", IN])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    sites = [Site("qkv.0", "x", "y", IN, out, (Member("q_proj", 0, Q), Member("k_proj", Q, KV),
                                                Member("v_proj", Q + KV, KV))),
             Site("layers.0.o_proj", "y", "z", out, IN, (Member("o_proj", 0, IN),))]
    add_lora_branches(model, sites)
    return model, sites


def _feeds(sites, n=10, slots=3, rank=4):
    rng = np.random.default_rng(2)
    token_slots = rng.integers(-1, slots, n).astype(np.int64)
    feeds = {"input_ids": np.zeros(n, np.int64), "x": rng.normal(0, 1, (1, n, IN)).astype(np.float32),
             **slot_masks(sites, token_slots, slots, rank)}
    for site in sites:
        widths = [m.width for m in site.members]
        feeds[a_name(site)], feeds[b_name(site)] = _stacks(rng, site.in_features, widths, slots, rank, [rank] * slots)
    return feeds


def _prepared(model, tmp_path, monkeypatch, fusion: bool = True) -> tuple[onnx.ModelProto, ort.SessionOptions]:
    monkeypatch.setenv(lora_fusion.SWITCH, "1" if fusion else "0")
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    prepared = cpu_kernels.prepare(path, options)
    return (onnx.load_from_string(prepared) if isinstance(prepared, bytes) else onnx.load(prepared)), options


def test_fusion_replaces_exactly_each_branch(tmp_path, monkeypatch):
    """A graph the compiler's pass wrote: each site's four nodes become one llmc.LoraDelta where its Add was, every
    other node stays as it was, and the session computes what the stored graph does."""
    model, sites = _lora_graph()
    fused, options = _prepared(model, tmp_path, monkeypatch)
    kept = [n for n in model.graph.node if not n.name.startswith("lora/")]
    assert [n for n in fused.graph.node if not n.name.startswith("lora/")] == kept
    lora = [n for n in fused.graph.node if n.name.startswith("lora/")]
    assert [(n.name, n.op_type, n.domain) for n in lora] == [
        (f"lora/{s.name}/LoraDelta", "LoraDelta", "llmc") for s in sites]
    assert [n.name for n in fused.graph.node] == ["qkv", "lora/qkv.0/LoraDelta", "o", "lora/layers.0.o_proj/LoraDelta"]
    for site, node in zip(sites, lora):
        assert list(node.input) == [f"lora/{site.name}/base", site.x, a_name(site), mask_name(len(site.members)),
                                    b_name(site)] and list(node.output) == [site.y]
        assert {a.name: helper.get_attribute_value(a) for a in node.attribute} == {"threads": 2,
                                                                                   "site": site.name.encode()}
    feeds = _feeds(sites)
    got = ort.InferenceSession(fused.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, feeds)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    assert np.allclose(got[0], want[0], rtol=1e-5, atol=1e-4) and np.abs(want[0]).max() > 1


def test_switch_off_and_changed_branches_keep_their_nodes(tmp_path, monkeypatch):
    """LLMC_LORA_FUSION=0 leaves the graph as stored; a branch whose nodes were changed (an intermediate value read
    by another node too, an op renamed) keeps its four nodes while the others are fused."""
    model, sites = _lora_graph()
    unfused, _ = _prepared(model, tmp_path, monkeypatch, fusion=False)
    assert not any(n.op_type == "LoraDelta" for n in unfused.graph.node)
    probed = onnx.ModelProto()
    probed.CopyFrom(model)
    probed.graph.output.append(helper.make_tensor_value_info("lora/qkv.0/h", TensorProto.FLOAT, None))
    renamed = onnx.ModelProto()
    renamed.CopyFrom(model)
    next(n for n in renamed.graph.node if n.name == "lora/qkv.0/Mul_mask").name = "lora/qkv.0/mask_by_hand"
    for changed in (probed, renamed):
        fused, _ = _prepared(changed, tmp_path, monkeypatch)
        ops = [n.op_type for n in fused.graph.node if n.name.startswith("lora/qkv.0/")]
        assert ops == ["MatMul", "Mul", "MatMul", "Add"]
        assert [n.op_type for n in fused.graph.node if n.name.startswith("lora/layers.0.o_proj/")] == ["LoraDelta"]


@pytest.mark.parametrize("bias", [False, True])
def test_fusion_after_the_int4_swap_and_its_bias_fold(tmp_path, monkeypatch, bias):
    """An int4 base: its MatMulNBits becomes llmc.MatMulNBits4 (the bias Add folded into it), whose output is the
    branch's y_base, and the branch is fused after it; the session equals the stored graph on ONNX Runtime's own
    kernels (both quantize the activations to int8 alike) to float rounding."""
    if cpu_kernels.load() is None:
        pytest.skip("no 4-bit kernel here")
    model, sites = _lora_graph(int4=True, bias=bias)
    fused, options = _prepared(model, tmp_path, monkeypatch)
    ops = [(n.name, n.op_type) for n in fused.graph.node]
    assert ops == [("qkv", "MatMulNBits4"), ("lora/qkv.0/LoraDelta", "LoraDelta"), ("o", "MatMul"),
                   ("lora/layers.0.o_proj/LoraDelta", "LoraDelta")]
    q4 = fused.graph.node[0]
    assert list(q4.output) == ["lora/qkv.0/base"] and (list(q4.input)[5:] == ["bias"]) == bias
    feeds = _feeds(sites)
    got = ort.InferenceSession(fused.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, feeds)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    assert np.allclose(got[0], want[0], rtol=1e-4, atol=1e-3) and np.abs(want[0]).max() > 1
