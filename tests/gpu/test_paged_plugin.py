"""The paged attention op up to the TensorRT boundary: the `LlmcPagedAttention` plugin node a paged
export is rewritten to (plugins/op/paged_node.py: schema, checker, shape inference, and what the node
computes, run through the plugin's kernel under TRITON_INTERPRET=1), and the `tensorrt.plugin`
registration (plugins/trt/plugin.py, trt_paged_plugin.py) over a stand-in that checks the signatures
as TensorRT's validator does and records the AOT launch. The plugin's PTX calling convention is
tests/gpu/test_paged_triton.py's; an engine with the plugin needs TensorRT and a GPU (none here)."""

import inspect
import os
import sys
import types
import typing

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

os.environ.setdefault("TRITON_INTERPRET", "1")  # the plugin's kernel runs on NumPy here
pytest.importorskip("triton", reason="the plugin's kernel needs OpenAI Triton (installed by scripts/setup.sh)")

import torch  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402
from onnx.reference.op_run import OpRun  # noqa: E402

from llmc import compiler  # noqa: E402  (its build, looked up when called: the pipeline needs the export extra)
from llmc.compiler.spec import parse_spec  # noqa: E402
from llmc.plugins.gpu import paged_kernels_aot  # noqa: E402
from llmc.plugins.op import paged_schema  # noqa: E402
from llmc.plugins.trt import plugin as trt_plugin  # noqa: E402
from llmc.plugins.op.attention import reference_paged_attention  # noqa: E402
from llmc.plugins.op.lowering import register_schemas  # noqa: E402
from llmc.plugins.op.paged_node import PAGED_PLUGIN_OP, to_plugin_nodes  # noqa: E402

H, KVH, D, BLOCKS, BS = 6, 2, 16, 14, 4
F32 = TensorProto.FLOAT


def paged_node_model(*, rotary=True, packed=True, dtype=F32, extra=(), **attributes):
    """One llmc.PagedAttention node (as a paged export has it: packed QKV, rotary in the op)."""
    width = (H + 2 * KVH) * D if packed else H * D
    inputs = [("query", dtype, ["T", width])]
    inputs += [] if packed else [("key", dtype, ["T", KVH * D]), ("value", dtype, ["T", KVH * D])]
    inputs += [("key_cache", dtype, [BLOCKS, BS, KVH, D]), ("value_cache", dtype, [BLOCKS, BS, KVH, D]),
               ("cumulative_sequence_length", TensorProto.INT32, ["B1"]), ("past_seqlens", TensorProto.INT32, ["B"]),
               ("block_table", TensorProto.INT32, ["B", "M"])]
    inputs += [("cos_cache", dtype, [64, D // 2]), ("sin_cache", dtype, [64, D // 2])] if rotary else []
    names = [n for n, _, _ in inputs]
    node_inputs = names[:1] + (["", ""] if packed else names[1:3]) + names[(1 if packed else 3):]
    for name in extra:  # at its contract index: slot_mapping (int32 [T]) 10, head_sink ([H]) 11
        node_inputs += [""] * ([n for n, _, _ in paged_schema.INPUTS].index(name) - len(node_inputs)) + [name]
        inputs.append((name, dtype, [H]) if name == "head_sink" else (name, TensorProto.INT32, ["T"]))
    node = helper.make_node("PagedAttention", node_inputs, ["out", "present.0.key", "present.0.value"], name="attn0",
                            domain="llmc", num_heads=H, kv_num_heads=KVH, do_rotary=int(rotary), **attributes)
    outputs = [helper.make_tensor_value_info(n, dtype, s) for n, s in (("out", ["T", H * D]),
               ("present.0.key", [BLOCKS, BS, KVH, D]), ("present.0.value", [BLOCKS, BS, KVH, D]))]
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(*i) for i in inputs], outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid("llmc", 1)])


class LlmcPagedAttention(OpRun):
    """The plugin node as the plugin computes it: its attributes mapped to the one-launch kernel's arguments."""

    op_domain = "llmc"

    def _run(self, q, k, v, kc, vc, cu, past, table, cos, sin, sink, **_):
        a = {n: getattr(self, n) for n in ("num_heads", "kv_num_heads", "head_size", "rotary_dim", "scale",
                                           "rotary_interleaved", "softcap", "local_window_size", "is_causal", "sinks")}
        assert sink.shape == (a["num_heads"],)
        assert cos.shape[1] == (a["rotary_dim"] // 2 or a["head_size"] // 2)
        tables = (torch.from_numpy(cos), torch.from_numpy(sin)) if a["rotary_dim"] else (None, None)
        kc, vc = torch.from_numpy(kc.copy()), torch.from_numpy(vc.copy())
        out, kc, vc = paged_kernels_aot.paged_attention_one_launch(
            *(torch.from_numpy(x) for x in (q, k, v)), kc, vc, *(torch.from_numpy(x) for x in (cu, past, table)),
            a["num_heads"], a["kv_num_heads"], a["scale"], *tables, rotary_interleaved=bool(a["rotary_interleaved"]),
            softcap=a["softcap"], local_window_size=a["local_window_size"], is_causal=bool(a["is_causal"]),
            head_sink=torch.from_numpy(sink) if a["sinks"] else None)
        return out.numpy(), kc.numpy(), vc.numpy()


def _feeds(model, seed=0):
    rng = np.random.default_rng(seed)
    lens, pasts = [1, 6, 0, 3], [9, 2, 4, 0]
    feeds = {"cumulative_sequence_length": np.array([0, *np.cumsum(lens)], np.int32),
             "past_seqlens": np.array(pasts, np.int32),
             "block_table": rng.permutation(BLOCKS)[:12].reshape(4, 3).astype(np.int32)}
    feeds["block_table"][3, 1:] = -1
    for i in model.graph.input:
        if i.name not in feeds:
            shape = [sum(lens) if not d.HasField("dim_value") else d.dim_value for d in i.type.tensor_type.shape.dim]
            feeds[i.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def _reference(model, feeds, **options):
    t = {n: torch.from_numpy(v.copy()) for n, v in feeds.items()}
    args = {k: t.get(k) for k in ("key", "value", "cos_cache", "sin_cache", "head_sink")}
    return reference_paged_attention(t["query"], args["key"], args["value"], t["key_cache"], t["value_cache"],
                                     t["cumulative_sequence_length"], t["past_seqlens"], t["block_table"], H, KVH,
                                     cos_cache=args["cos_cache"], sin_cache=args["sin_cache"],
                                     head_sink=args["head_sink"], **options)


@pytest.mark.parametrize("rotary, packed, sinks, attributes", [
    (True, True, False, {}),
    (False, False, True, {"scale": 0.3}),
    (True, False, True, {"rotary_interleaved": 1, "softcap": 3.0, "local_window_size": 5}),
])
def test_plugin_node_computes_the_paged_contract(rotary, packed, sinks, attributes):
    model = paged_node_model(rotary=rotary, packed=packed, extra=["head_sink"] if sinks else [], **attributes)
    feeds = _feeds(model)
    assert to_plugin_nodes(model) == 1
    onnx.checker.check_model(model, full_check=True)
    ops = [n.op_type for n in model.graph.node]
    assert ops == (["Split"] if packed else []) + ([] if rotary else ["CastLike"]) + ([] if sinks else ["CastLike"]) \
        + [PAGED_PLUGIN_OP]
    node = model.graph.node[-1]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert (attrs["plugin_version"], attrs["plugin_namespace"], attrs["head_size"]) == (b"1", b"llmc", D)
    assert attrs["rotary_dim"] == (D if rotary else 0) and attrs["sinks"] == sinks and len(node.input) == 11
    assert (node.input[10] == "head_sink") == sinks
    assert list(node.output) == ["out", "present.0.key", "present.0.value"]
    got = ReferenceEvaluator(model, new_ops=[LlmcPagedAttention]).run(None, feeds)
    want = _reference(model, feeds, **{k: bool(v) if k == "rotary_interleaved" else v for k, v in attributes.items()})
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w.numpy(), atol=1e-5, rtol=1e-5)


def test_plugin_node_infers_types_and_refuses_wrong_ones():
    model = paged_node_model(dtype=TensorProto.FLOAT16)
    to_plugin_nodes(model)
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    out = {o.name: o.type.tensor_type for o in inferred.graph.output}
    assert out["out"].elem_type == TensorProto.FLOAT16 and [d.dim_param for d in out["out"].shape.dim] == ["T", ""]
    assert [d.dim_value for d in out["present.0.key"].shape.dim] == [BLOCKS, BS, KVH, D]
    past = next(i for i in model.graph.input if i.name == "past_seqlens")
    past.type.tensor_type.elem_type = TensorProto.INT64
    with pytest.raises(onnx.shape_inference.InferenceError, match="past_seqlens .*int64"):
        onnx.checker.check_model(model, full_check=True)


@pytest.mark.parametrize("extra, attributes, named", [
    (["slot_mapping"], {}, "input slot_mapping"),
    ((), {"k_quant_type": "PER_TENSOR"}, "attribute k_quant_type"),
    ((), {"rotary_offset": 3}, "attribute rotary_offset"),
])
def test_what_the_plugin_cannot_do_is_refused_by_name(extra, attributes, named):
    register_schemas()
    with pytest.raises(ValueError, match=f"node 'attn0'.*{named}"):
        to_plugin_nodes(paged_node_model(extra=extra, **attributes))


def test_a_paged_export_becomes_plugin_nodes(tiny_checkpoints, tmp_path):
    spec = parse_spec({"name": "t", "source": str(tiny_checkpoints["llama"]), "export": {"attention": "paged"}})
    result = compiler.build(spec, output=tmp_path / "out", until="export")
    model = onnx.load(str(tmp_path / "out" / "export" / result.exported.onnx))
    outputs = [o.name for o in model.graph.output]
    assert to_plugin_nodes(model) == result.exported.model.num_layers
    onnx.checker.check_model(model, full_check=True)
    assert not [n for n in model.graph.node if n.op_type == "PagedAttention"]
    assert [o.name for o in model.graph.output] == outputs  # present.* still the plugin's aliased caches
    plugins = [n for n in model.graph.node if n.op_type == PAGED_PLUGIN_OP]
    assert {helper.get_attribute_value(a) for n in plugins for a in n.attribute if a.name == "rotary_dim"} == \
           {result.exported.model.head_dim}


class _Expr:
    """A TensorRT shape expression (tensorrt.plugin's ShapeExpr) over a known value: +, -, * and // with an int or an
    expression on the right and no reflected operators, as TensorRT's has; compared with ints by value."""

    def __init__(self, value):
        self.value = value.value if isinstance(value, _Expr) else int(value)

    @staticmethod
    def _of(other):
        assert isinstance(other, (_Expr, int)), other
        return other.value if isinstance(other, _Expr) else other

    def __add__(self, other):
        return _Expr(self.value + self._of(other))

    def __sub__(self, other):
        return _Expr(self.value - self._of(other))

    def __mul__(self, other):
        return _Expr(self.value * self._of(other))

    def __floordiv__(self, other):
        return _Expr(self.value // self._of(other))

    def __neg__(self):
        return _Expr(-self.value)

    def __eq__(self, other):
        return self.value == self._of(other)

    def __hash__(self):
        return hash(self.value)

    def __repr__(self):
        return f"Expr({self.value})"


def _extremum(pick):
    def apply(first, second):  # tensorrt.plugin.min / max refuse two ints
        assert isinstance(first, _Expr) or isinstance(second, _Expr), "two ints: TensorRT raises ValueError"
        return _Expr(pick(_Expr(first).value, _Expr(second).value))
    return apply


class _Combination(str):
    """tensorrt.plugin.AutoTuneCombination: its I/O types (this string) and its custom tactics."""

    def __new__(cls, io_types, layouts=None, tactics=None):
        combination = super().__new__(cls, io_types)
        combination.tactics = list(tactics) if tactics is not None else None
        return combination


class _TensorDesc:
    """A TensorRT tensor description: a dtype and a shape expression (its dimensions `_Expr`s)."""

    def __init__(self, dtype="half", shape=()):
        self.dtype, self.shape_expr = dtype, [_Expr(d) for d in shape]

    def like(self):
        return ("like", self)

    def aliased(self):
        return ("aliased", self)


def _check_signature(fn, registered, tail, role):
    """tensorrt.plugin's rules: real classes as annotations, tensors first, then the attributes (at
    registration: all, else a subset of the registered ones in their order), then `tail`."""
    params = inspect.signature(fn).parameters
    for name, p in params.items():
        assert not isinstance(p.annotation, str), f"{role}: {name}'s annotation is a string"
    tensors = [n for n, p in params.items() if p.annotation is _TensorDesc]
    attrs = [n for n in params if n not in tensors and n not in tail]
    assert list(params) == tensors + attrs + tail, role
    assert registered is None or attrs == [n for n in registered if n in attrs], role
    return tensors, attrs


def _standin(monkeypatch):
    registry = {}

    def decorator(kind):
        return lambda plugin_id: lambda fn: registry.setdefault((plugin_id, kind), fn)

    trtp = types.ModuleType("tensorrt.plugin")
    trtp.TensorDesc, trtp.register, trtp.autotune, trtp.aot_impl = _TensorDesc, *map(decorator, ("register", "autotune",
                                                                                                 "aot_impl"))
    trtp.AutoTuneCombination = _Combination
    trtp.KernelLaunchParams = types.SimpleNamespace
    trtp.SymInt32 = lambda e: ("i32", e)
    trtp.SymIntExprs = types.SimpleNamespace(from_tuple=tuple)
    trtp.cdiv = lambda a, b: -(-a // b)
    trtp.min, trtp.max, trtp.ShapeExpr = _extremum(min), _extremum(max), _Expr
    trt = types.ModuleType("tensorrt")
    trt.float32, trt.float16, trt.bfloat16, trt.plugin = "float", "half", "bf16", trtp
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", trtp)
    monkeypatch.setitem(trt_plugin._state, "registered", False)
    monkeypatch.setitem(trt_plugin._state, "capability", 80)
    return registry


def test_both_plugins_register_with_signatures_tensorrt_accepts(monkeypatch):
    registry = _standin(monkeypatch)
    trt_plugin.register()
    trt_plugin.register()  # idempotent
    assert set(registry) == {(p, k) for p in ("llmc::LlmcFusedAttention", "llmc::LlmcPagedAttention")
                             for k in ("register", "autotune", "aot_impl")}
    for plugin_id in ("llmc::LlmcFusedAttention", "llmc::LlmcPagedAttention"):
        describe = registry[(plugin_id, "register")]
        tensors, attrs = _check_signature(describe, None, [], "register")
        assert all(inspect.signature(describe).parameters[a].annotation in (int, float) for a in attrs)
        outputs = typing.get_args(inspect.signature(describe).return_annotation)
        assert outputs == (_TensorDesc,) * 5  # the output, the caches and the split buffers aliased
        _check_signature(registry[(plugin_id, "autotune")], attrs, ["outputs"], "autotune")
        aot = registry[(plugin_id, "aot_impl")]
        _check_signature(aot, attrs, ["outputs", "tactic"], "aot_impl")
        assert len(typing.get_args(inspect.signature(aot).return_annotation)) == 4
    paged = registry[("llmc::LlmcPagedAttention", "register")]
    formats = registry[("llmc::LlmcPagedAttention", "autotune")](*[None] * 14)[0].split(", ")
    assert len(formats) == 18 and formats[5:8] == ["INT32"] * 3
    assert formats[11:13] == formats[16:] == ["FP32", "INT32"]  # the split workspace and counters, in and out
    assert set(formats[:5] + formats[8:11] + formats[13:16]) == {"FP32|FP16|BF16"}
    descs = [_TensorDesc() for _ in range(13)]
    assert paged(*descs, *[0] * 12) == (("like", descs[0]), ("aliased", descs[3]), ("aliased", descs[4]),
                                        ("aliased", descs[11]), ("aliased", descs[12]))
    combination = registry[("llmc::LlmcFusedAttention", "autotune")](*[None] * 12)[0]
    assert combination.tactics == [trt_plugin.ONE_LAUNCH, trt_plugin.PREFILL]  # TensorRT times both per profile
    fused = combination.split(", ")
    assert len(fused) == 16 and fused[5] == "INT32" and fused[9:11] == fused[14:] == ["FP32", "INT32"]
    assert set(fused[:5] + fused[6:9] + fused[11:14]) == {"FP32|FP16|BF16"}
    descs = [_TensorDesc() for _ in range(11)]
    assert registry[("llmc::LlmcFusedAttention", "register")](*descs, *[0] * 11)[3:] == (("aliased", descs[9]),
                                                                                       ("aliased", descs[10]))


def test_paged_aot_impl_compiles_for_the_node_and_launches_over_shape_expressions(monkeypatch):
    registry = _standin(monkeypatch)
    asked = []

    def compiled(*args, **kwargs):
        asked.append((args, kwargs))
        return paged_kernels_aot.PagedPluginKernel("_paged_attention", "ptx", 4, 9216, 16, kwargs["splits"],
                                                   kwargs["slots"])

    monkeypatch.setattr(paged_kernels_aot, "paged_plugin_kernel", compiled)
    trt_plugin.register()
    tokens, rows, width, blocks, block_size = 37, 3, 40, 150, 16
    descs = [_TensorDesc("bf16", s) for s in ([tokens, H * D], [tokens, KVH * D], [tokens, KVH * D],
                                              [blocks, block_size, KVH, D], [blocks, block_size, KVH, D], [rows + 1],
                                              [rows], [rows, width], [64, D // 2], [64, D // 2], [H],
                                              [264 * 16 * (D + 2)], [264])]
    name, ptx, launch, extra = registry[("llmc::LlmcPagedAttention", "aot_impl")](
        *descs, H, KVH, D, D, 0, 7, 1, 1, 0.25, 2.5, 8, 264, outputs=(), tactic=0)
    assert asked == [((H, KVH, D, 0.25, "bf16", 80), {"rotary_dim": D, "interleaved": False, "softcap": 2.5,
                                                      "window": 7, "causal": True, "sinks": True, "splits": 8,
                                                      "slots": 264})]
    assert (name, ptx, launch.block_x, launch.shared_mem) == ("_paged_attention", "ptx", 128, 9216)
    # 7 + 3 row tiles x 2 KV heads: 264 // 20 = 13 splits' partials fit; 640 keys a row make 2 slices of 256
    assert (launch.grid_x, launch.grid_y, launch.grid_z) == (-(-tokens * (H // KVH) // 16) + rows, KVH, 2)
    assert extra == (("i32", rows), ("i32", width), ("i32", blocks), ("i32", block_size))


@pytest.mark.tensorrt
def test_an_engine_with_the_paged_plugin_matches_the_reference(tmp_path):
    """Written against TensorRT 10.14+/11, never run: no TensorRT or GPU has been available here."""
    trt = pytest.importorskip("tensorrt", reason="TensorRT is not installable here (docs/tensorrt.md)")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU here: the paged plugin is tested up to TensorRT on CPU")
    from llmc.compiler.tensorrt.engine import network_from_onnx

    model = paged_node_model(dtype=TensorProto.FLOAT16)
    feeds = {n: v.astype(np.float16) if v.dtype == np.float32 else v for n, v in _feeds(model).items()}
    want = _reference(model, feeds)
    to_plugin_nodes(model)
    onnx.save(model, str(tmp_path / "paged.onnx"))
    trt_plugin.set_target_capability(None)
    trt_plugin.register()
    net = network_from_onnx(tmp_path / "paged.onnx")()
    config, profile = net.builder.create_builder_config(), net.builder.create_optimization_profile()
    tensors = {n: torch.from_numpy(v).cuda() for n, v in feeds.items()}
    for name, t in tensors.items():
        profile.set_shape(name, tuple(t.shape), tuple(t.shape), tuple(t.shape))
    config.add_optimization_profile(profile)
    engine = trt.Runtime(net.logger).deserialize_cuda_engine(net.builder.build_serialized_network(net.network, config))
    context = engine.create_execution_context()
    out = torch.empty((feeds["query"].shape[0], H * D), dtype=torch.float16, device="cuda")
    for name, t in tensors.items():
        context.set_input_shape(name, tuple(t.shape))
        context.set_tensor_address(name, t.data_ptr())
    for name, t in (("out", out), ("present.0.key", tensors["key_cache"]), ("present.0.value", tensors["value_cache"])):
        context.set_tensor_address(name, t.data_ptr())  # the caches: aliased, the same memory
    assert context.execute_async_v3(torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    for got, ref in zip((out, tensors["key_cache"], tensors["value_cache"]), want):
        torch.testing.assert_close(got.float().cpu(), ref.float(), atol=2e-2, rtol=2e-2)
