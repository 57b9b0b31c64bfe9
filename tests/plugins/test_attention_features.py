"""The per-layer attention features (a window, a logit softcap, attention sinks, partial rotary) in the
op's reference, against a plain per-row computation, and through the ONNX lowerings ONNX Runtime runs
(GroupQueryAttention, opset-23 Attention) on the installed ONNX Runtime: GQA's `local_window_size`
changed meaning in 1.24 (W + 1 keys before, W after), and llmc's window is W keys, itself included."""

import math

import numpy as np
import pytest
import torch

from llmc.plugins.op.attention import reference_attention, reference_paged_attention

B, S, H, KVH, D, C = 2, 5, 4, 2, 32, 12
FEATURES = {"window": dict(local_window_size=3), "softcap": dict(softcap=2.0), "sinks": dict(head_sink=True),
            "partial_rotary": dict(rotary=16), "all": dict(local_window_size=4, softcap=3.0, head_sink=True, rotary=16)}


def _case(seed=0, rotary=0, head_sink=False, **features):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, S, n, D, generator=g) * 2 for n in (H, KVH, KVH))
    kc, vc = torch.randn(B, KVH, C, D, generator=g), torch.randn(B, KVH, C, D, generator=g)
    position = torch.tensor([6, 2])  # rows at different positions; row 0 sees older cache entries
    tables = ()
    if rotary:
        angles = torch.rand(C, rotary // 2, generator=g) * 6
        tables = (angles.cos(), angles.sin())
    sink = torch.randn(H, generator=g) if head_sink else None
    return (q, k, v, kc, vc, position, D ** -0.5, *tables), dict(head_sink=sink, **features)


def _naive(q, k, v, kc, vc, position, scale, cos=None, sin=None, head_sink=None, softcap=0.0, local_window_size=-1):
    """Row by row, head by head, query by query: what the reference must equal."""
    out = torch.zeros_like(q)
    for b in range(B):
        keys, values = kc[b].clone(), vc[b].clone()
        qs, ks = q[b].clone(), k[b].clone()
        for i in range(S):
            p = int(position[b]) + i
            if cos is not None:
                r = cos.shape[1]
                for x in (qs[i], ks[i]):
                    x1, x2 = x[:, :r].clone(), x[:, r:2 * r].clone()
                    x[:, :r], x[:, r:2 * r] = x1 * cos[p] - x2 * sin[p], x2 * cos[p] + x1 * sin[p]
            keys[:, p], values[:, p] = ks[i], v[b, i]
        for i in range(S):
            p = int(position[b]) + i
            for h in range(H):
                kv = h // (H // KVH)
                seen = [j for j in range(p + 1) if local_window_size <= 0 or j > p - local_window_size]
                logits = [float(qs[i, h] @ keys[kv, j]) * scale for j in seen]
                if softcap > 0:
                    logits = [softcap * math.tanh(x / softcap) for x in logits]
                top = max(logits + ([float(head_sink[h])] if head_sink is not None else []))
                weights = [math.exp(x - top) for x in logits]
                total = sum(weights) + (math.exp(float(head_sink[h]) - top) if head_sink is not None else 0.0)
                out[b, i, h] = sum(w / total * values[kv, j] for w, j in zip(weights, seen))
    return out


@pytest.mark.parametrize("feature", FEATURES)
def test_the_reference_equals_a_plain_per_row_computation(feature):
    args, kwargs = _case(**FEATURES[feature])
    torch.testing.assert_close(reference_attention(*args, **kwargs)[0], _naive(*args, **kwargs), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("feature", FEATURES)
def test_the_paged_reference_agrees_with_the_slot_reference(feature):
    """The same rows through block tables (blocks of 4, shuffled) give the slot op's outputs."""
    args, kwargs = _case(**FEATURES[feature])
    q, k, v, kc, vc, position, scale, *tables = args
    block, order = 4, torch.tensor([5, 2, 0, 4, 1, 3])  # row 0: blocks 5, 2, 0; row 1: 4, 1, 3
    pool_k, pool_v = torch.zeros(6, block, KVH, D), torch.zeros(6, block, KVH, D)
    table = order.view(B, C // block).to(torch.int32)
    for b in range(B):
        for p in range(int(position[b])):  # the rows' cached tokens
            pool_k[table[b, p // block], p % block], pool_v[table[b, p // block], p % block] = kc[b, :, p], vc[b, :, p]
    want = reference_attention(*args, **kwargs)[0]
    got, _, _ = reference_paged_attention(
        q.reshape(B * S, H * D), k.reshape(B * S, KVH * D), v.reshape(B * S, KVH * D), pool_k, pool_v,
        torch.tensor([0, S, 2 * S], dtype=torch.int32), position.to(torch.int32), table, H, KVH, scale,
        *(tables or (None, None)), softcap=kwargs.get("softcap", 0.0),
        local_window_size=kwargs.get("local_window_size", -1), head_sink=kwargs["head_sink"])
    torch.testing.assert_close(got.view(B, S, H, D), want, rtol=1e-4, atol=1e-4)


def _run_lowering(lowering, args, kwargs, tmp_path):
    import onnxruntime as ort

    from llmc.plugins.op.lowering import Heads, Lowering, translation_table, trim_unused_outputs

    tables, sink = args[7:], kwargs["head_sink"]
    features = dict(softcap=kwargs.get("softcap", 0.0), window=kwargs.get("local_window_size", -1))

    class Layer(torch.nn.Module):  # the tables and sinks as buffers, as a decoder holds them
        def __init__(self):
            super().__init__()
            for name, value in zip(("cos", "sin", "sink"), (*(tables or (None, None)), sink)):
                self.register_buffer(name, value)

        def forward(self, q, k, v, kc, vc, position):
            return torch.ops.llmc.attention(q, k, v, kc, vc, position, args[6], self.cos, self.sin, self.sink,
                                            features["softcap"], features["window"])

    program = torch.onnx.export(Layer(), tuple(args[:6]), dynamo=True, opset_version=23, optimize=False,
                                custom_translation_table=translation_table(Lowering(lowering), Heads(H, KVH, D)))
    proto = program.model_proto
    trim_unused_outputs(proto.graph)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = dict(zip([i.name for i in session.get_inputs()], (a.numpy() for a in args[:6])))
    return session.run(None, feeds)[0]


@pytest.mark.parametrize("lowering", ["fused", "reference"])
@pytest.mark.parametrize("feature", FEATURES)
def test_onnx_runtime_runs_each_lowering_as_the_reference_defines_it(lowering, feature, tmp_path):
    args, kwargs = _case(**FEATURES[feature])
    if lowering == "reference" and kwargs["head_sink"] is not None:
        with pytest.raises(Exception, match="attention sinks"):
            _run_lowering(lowering, args, kwargs, tmp_path)
        return
    want = reference_attention(*args, **kwargs)[0].numpy()
    if lowering == "reference":
        got = _run_lowering(lowering, args, kwargs, tmp_path)
    else:  # GQA on CPU prefills one row at a time when the row has a past (the fused layout's max_prefill_rows)
        got = np.concatenate([_run_lowering(lowering, [a[b:b + 1] for a in args[:6]] + list(args[6:]), kwargs,
                                            tmp_path) for b in range(B)])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
