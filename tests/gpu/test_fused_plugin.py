"""The `LlmcFusedAttention` TensorRT plugin node (llmc::attention's `plugin` lowering, plugins/op/fused_node.py)
with the attention features, up to the TensorRT boundary: an exported op with sinks, softcap, a window and
partial rotary becomes one node carrying them as fields (the sinks an input), the checker accepts it, and what the
node computes, run through the plugin's one-launch kernel under TRITON_INTERPRET=1, is the op's reference; the
`tensorrt.plugin` AOT implementation (over test_paged_plugin.py's stand-in) compiles the kernel for those fields.
An engine with the plugin needs TensorRT and a GPU (none here)."""

import os

import numpy as np
import onnx
import pytest
from onnx import helper

os.environ.setdefault("TRITON_INTERPRET", "1")  # the plugin's kernel runs on NumPy here
pytest.importorskip("triton", reason="the plugin's kernel needs OpenAI Triton (installed by scripts/setup.sh)")

import torch  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402  (before the schemas register: see test_paged_plugin)
from onnx.reference.op_run import OpRun  # noqa: E402

from llmc.plugins.gpu import kernels_aot  # noqa: E402
from llmc.plugins.op.attention import reference_attention  # noqa: E402
from llmc.plugins.op.lowering import PLUGIN_OP, Heads, Lowering, translation_table  # noqa: E402
from llmc.plugins.trt import plugin as trt_plugin  # noqa: E402

from test_paged_plugin import _standin, _TensorDesc  # noqa: E402

B, S, H, KVH, D, C = 2, 5, 6, 2, 16, 24
FIELDS = ("num_heads", "num_kv_heads", "head_dim", "scale", "rotary", "rotary_dim", "softcap", "local_window_size",
          "sinks")


class LlmcFusedAttention(OpRun):
    """The plugin node as the plugin computes it: its fields mapped to the one-launch kernel's arguments."""

    op_domain = "llmc"

    def _run(self, q, k, v, kc, vc, pos, cos, sin, sink, **_):
        a = {n: getattr(self, n) for n in FIELDS}
        assert q.shape[2:] == (a["num_heads"], a["head_dim"]) and sink.shape == (a["num_heads"],)
        assert not a["rotary"] or 2 * cos.shape[1] == a["rotary_dim"]
        tables = (torch.from_numpy(cos), torch.from_numpy(sin)) if a["rotary"] else (None, None)
        kc, vc = torch.from_numpy(kc.copy()), torch.from_numpy(vc.copy())
        out = kernels_aot.one_launch_attention(
            *(torch.from_numpy(x) for x in (q, k, v)), kc, vc, torch.from_numpy(pos), a["scale"], *tables,
            torch.from_numpy(sink) if a["sinks"] else None, a["softcap"], a["local_window_size"])
        return out.numpy(), kc.numpy(), vc.numpy()


class _Layer(torch.nn.Module):
    """One llmc::attention call, its sinks a parameter and its rotary tables buffers (as a decoder has them)."""

    def __init__(self, sinks, rotary_dim, softcap, window):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.sinks = torch.nn.Parameter(torch.rand(H, generator=g) * 8 - 3, requires_grad=False) if sinks else None
        angles = torch.rand(C, rotary_dim // 2, generator=g) * 6 if rotary_dim else None
        self.cos, self.sin = (angles.cos(), angles.sin()) if rotary_dim else (None, None)
        self.softcap, self.window = softcap, window

    def forward(self, query, key, value, k_cache, v_cache, cache_position):
        return torch.ops.llmc.attention(query, key, value, k_cache, v_cache, cache_position, 0.3, self.cos, self.sin,
                                        self.sinks, self.softcap, self.window)


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, S, H, D, generator=g), torch.randn(B, S, KVH, D, generator=g),
            torch.randn(B, S, KVH, D, generator=g), torch.randn(B, KVH, C, D, generator=g),
            torch.randn(B, KVH, C, D, generator=g), torch.tensor([0, 11]))


@pytest.mark.parametrize("sinks, rotary_dim, softcap, window", [
    (False, 0, 0.0, -1),  # no feature: placeholders, fields off
    (True, 8, 2.0, 4),  # all of them, partial rotary, a window shorter than the prompt
])
def test_plugin_node_carries_the_features_and_computes_the_op(sinks, rotary_dim, softcap, window):
    layer = _Layer(sinks, rotary_dim, softcap, window)
    inputs = _inputs()
    table = translation_table(Lowering.plugin, Heads(H, KVH, D))
    names = ["query", "key", "value", "k_cache", "v_cache", "cache_position"]
    model = torch.onnx.export(layer, inputs, input_names=names, output_names=["output", "k_out", "v_out"],
                              opset_version=23, dynamo=True, custom_translation_table=table, verbose=False,
                              report=False).model_proto
    onnx.checker.check_model(model, full_check=True)
    nodes = [n for n in model.graph.node if n.op_type == PLUGIN_OP]
    assert len(nodes) == 1 and len(nodes[0].input) == 9
    attrs = {a.name: helper.get_attribute_value(a) for a in nodes[0].attribute}
    assert {n: attrs[n] for n in FIELDS[4:]} == {"rotary": int(bool(rotary_dim)), "rotary_dim": rotary_dim,
                                                 "softcap": pytest.approx(softcap), "local_window_size": window,
                                                 "sinks": int(sinks)}
    got = ReferenceEvaluator(model, new_ops=[LlmcFusedAttention]).run(
        None, {n: x.numpy() for n, x in zip(names, inputs)})
    want = reference_attention(*inputs, 0.3, layer.cos, layer.sin, layer.sinks, softcap, window)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w.numpy(), atol=2e-5, rtol=2e-5)


def test_fused_aot_impl_compiles_the_kernel_for_the_nodes_fields(monkeypatch):
    registry = _standin(monkeypatch)
    asked = []

    def compiled(*args, **kwargs):
        asked.append((args, kwargs))
        return kernels_aot.PluginKernel("_attention_one_launch", "ptx", 4, 8192, 16, kwargs["splits"],
                                        kwargs["slots"])

    monkeypatch.setattr(kernels_aot, "plugin_kernel", compiled)
    trt_plugin.register()
    cap = 4096  # a cache of 4,096 tokens a row: 16 slices of 256 keys
    descs = [_TensorDesc("half", s) for s in ([B, S, H, D], [B, S, KVH, D], [B, S, KVH, D], [B, KVH, cap, D],
                                               [B, KVH, cap, D], [B], [C, 4], [C, 4], [H], [264 * 16 * (D + 2)], [264])]
    name, ptx, launch, extra = registry[("llmc::LlmcFusedAttention", "aot_impl")](
        *descs, H, KVH, D, 0.3, 1, 8, 2.5, 9, 1, 16, 264, outputs=(), tactic=0)
    assert asked == [((H, KVH, D, 0.3, "fp16", 80), {"rotary": True, "rotary_dim": 8, "softcap": 2.5, "window": 9,
                                                     "sinks": True, "splits": 16, "slots": 264})]
    assert (name, ptx, launch.block_x, launch.shared_mem) == ("_attention_one_launch", "ptx", 128, 8192)
    # one row tile x 4: 264 // 4 = 66 splits' partials would fit, 16 slices of the capacity, key_splits 16
    assert (launch.grid_x, launch.grid_y, launch.grid_z) == (-(-S * (H // KVH) // 16), B * KVH, 16)
    assert extra == (("i32", S), ("i32", cap))
    registry[("llmc::LlmcFusedAttention", "aot_impl")](*descs, H, KVH, D, 0.3, 0, 0, 0.0, -1, 0, 1, 0, outputs=(),
                                                       tactic=trt_plugin.ONE_LAUNCH)
    assert asked[-1][1] == {"rotary": False, "rotary_dim": D, "softcap": 0.0, "window": -1, "sinks": False,
                            "splits": 1, "slots": 0}


def test_the_prefill_tactic_compiles_the_prefill_kernel_with_its_own_grid(monkeypatch):
    """Tactic PREFILL: slot_prefill.py's kernel for the same fields (no key splits), one program per 64 tokens of
    one query head: (tiles of S, B x H, 1)."""
    registry = _standin(monkeypatch)
    asked = []

    def compiled(*args, **kwargs):
        asked.append((args, kwargs))
        return kernels_aot.PluginKernel("_slot_prefill", "ptx", 4, 32768, 64, prefill=True)

    monkeypatch.setattr(kernels_aot, "plugin_prefill_kernel", compiled)
    trt_plugin.register()
    tokens = 300
    descs = [_TensorDesc("half", s) for s in ([B, tokens, H, D], [B, tokens, KVH, D], [B, tokens, KVH, D],
                                               [B, KVH, 4096, D], [B, KVH, 4096, D], [B], [C, 4], [C, 4], [H],
                                               [264 * 16 * (D + 2)], [264])]
    name, ptx, launch, extra = registry[("llmc::LlmcFusedAttention", "aot_impl")](
        *descs, H, KVH, D, 0.3, 1, 8, 2.5, 9, 1, 16, 264, outputs=(), tactic=trt_plugin.PREFILL)
    assert asked == [((H, KVH, D, 0.3, "fp16", 80), {"rotary": True, "rotary_dim": 8, "softcap": 2.5, "window": 9,
                                                     "sinks": True})]
    assert (name, launch.block_x, launch.shared_mem) == ("_slot_prefill", 128, 32768)
    assert (launch.grid_x, launch.grid_y, launch.grid_z) == (-(-tokens // 64), B * H, 1)
    assert extra == (("i32", tokens), ("i32", 4096))
