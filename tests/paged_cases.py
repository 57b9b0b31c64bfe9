"""Paged-attention test cases shared by the op's schema tests (tests/plugins) and the CPU kernel's
(tests/runtime/kernels): one PagedAttention node as a graph, random inputs over scattered blocks, and the
torch reference's answer for them."""

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

from llmc.plugins.op import paged_schema
from llmc.plugins.op.attention import reference_paged_attention


def paged_model(domain: str, dtype: int, *, heads=4, kv_heads=2, head_size=8, blocks=6, block_size=4,
                rotary=False, rotary_dim=None, packed=False, outputs=3, extra_inputs=(), **attributes) -> onnx.ModelProto:
    """One PagedAttention node over graph inputs named as its inputs; symbolic token and row counts; rotary
    tables [P, rotary_dim / 2] (default: the whole head)."""
    hidden, kv_hidden = heads * head_size, kv_heads * head_size
    cache = [blocks, block_size, kv_heads, head_size]
    inputs = [("query", dtype, ["T", hidden + 2 * kv_hidden if packed else hidden])]
    inputs += [] if packed else [("key", dtype, ["T", kv_hidden]), ("value", dtype, ["T", kv_hidden])]
    inputs += [("key_cache", dtype, cache), ("value_cache", dtype, cache),
               ("cumulative_sequence_length", TensorProto.INT32, ["B1"]), ("past_seqlens", TensorProto.INT32, ["B"]),
               ("block_table", TensorProto.INT32, ["B", "M"])]
    half = (rotary_dim or head_size) // 2
    inputs += [("cos_cache", dtype, ["P", half]), ("sin_cache", dtype, ["P", half])] if rotary else []
    names = [n for n, _, _ in inputs]
    node_inputs = names[:1] + (["", ""] if packed else names[1:3]) + names[(1 if packed else 3):]
    node_inputs += [""] * (10 - len(node_inputs)) if extra_inputs else []
    for name, elem, shape in extra_inputs:  # (name, type, shape) at their contract index
        index = [n for n, _, _ in paged_schema.INPUTS].index(name)
        node_inputs += [""] * (index - len(node_inputs)) + [name]
        inputs.append((name, elem, shape))
    outs = ["output", "key_cache_out", "value_cache_out"][:outputs]
    node = helper.make_node("PagedAttention", node_inputs, outs, domain=domain, num_heads=heads,
                            kv_num_heads=kv_heads, do_rotary=int(rotary), **attributes)
    out_types = [("output", dtype, ["T", hidden]), ("key_cache_out", dtype, cache), ("value_cache_out", dtype, cache)]
    graph = helper.make_graph([node], "paged", [helper.make_tensor_value_info(*i) for i in inputs],
                              [helper.make_tensor_value_info(*o) for o in out_types[:outputs]])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(domain, 1)])


def case(rows, heads, kv_heads, head_size, block_size, *, seed=0, rotary=False, fp16=False, spare_blocks=3,
         packed=False, int8=None, rotary_dim=None, sinks=False):
    """Rows [(past, new)], each row's blocks scattered over a pool with stale data everywhere. int8:
    "PER_TENSOR" or "PER_CHANNEL", an int8 cache of random codes with such k_scale and v_scale (the
    per-channel ones spread over 30x, so a channel's scale visibly matters). rotary_dim: partial rotary
    tables (default: the whole head). sinks: a head_sink [heads] spread over [-3, 5], so that a sink takes
    from nothing to most of a softmax's mass."""
    rng = np.random.default_rng(seed)
    per_row = [-(-(p + n) // block_size) for p, n in rows]
    width = max(per_row) + 1
    blocks = sum(per_row) + spare_blocks
    order = rng.permutation(blocks)
    table = np.full((len(rows), width), -1, np.int32)
    at = 0
    for b, count in enumerate(per_row):
        table[b, :count] = order[at:at + count]
        at += count
    tokens = sum(n for _, n in rows)
    cache_type = np.float16 if fp16 else np.float32
    hidden = (heads + 2 * kv_heads) * head_size if packed else heads * head_size
    feeds = {
        "query": rng.standard_normal((tokens, hidden), np.float32),
        "key_cache": rng.standard_normal((blocks, block_size, kv_heads, head_size)).astype(cache_type),
        "value_cache": rng.standard_normal((blocks, block_size, kv_heads, head_size)).astype(cache_type),
        "cumulative_sequence_length": np.array([0, *np.cumsum([n for _, n in rows])], np.int32),
        "past_seqlens": np.array([p for p, _ in rows], np.int32),
        "block_table": table,
    }
    if not packed:
        feeds["key"] = rng.standard_normal((tokens, kv_heads * head_size), np.float32)
        feeds["value"] = rng.standard_normal((tokens, kv_heads * head_size), np.float32)
    if rotary:
        angles = rng.random((max(p + n for p, n in rows) + 3, (rotary_dim or head_size) // 2), np.float32) * 6
        feeds["cos_cache"], feeds["sin_cache"] = np.cos(angles), np.sin(angles)
    if int8:
        for name in ("key_cache", "value_cache"):
            feeds[name] = rng.integers(-128, 128, feeds[name].shape).astype(np.int8)
        shape = (kv_heads, 1, head_size) if int8 == "PER_CHANNEL" else (1,)
        for name in ("k_scale", "v_scale"):  # new keys and values (~N(0, 1)) land mostly inside the codes' range
            feeds[name] = (np.exp(rng.uniform(np.log(0.01), np.log(0.3), shape))).astype(np.float32)
    if sinks:
        feeds["head_sink"] = rng.uniform(-3, 5, heads).astype(np.float32)
    return feeds


def reference(feeds, heads, kv_heads, **attributes):
    t = {k: torch.from_numpy(v.copy()) for k, v in feeds.items()}
    out, kc, vc = reference_paged_attention(
        t["query"], t.get("key"), t.get("value"), t["key_cache"], t["value_cache"], t["cumulative_sequence_length"],
        t["past_seqlens"], t["block_table"], heads, kv_heads, attributes.get("scale", 0.0), t.get("cos_cache"),
        t.get("sin_cache"), slot_mapping=t.get("slot_mapping"),
        rotary_interleaved=bool(attributes.get("rotary_interleaved", 0)), softcap=attributes.get("softcap", 0.0),
        local_window_size=attributes.get("local_window_size", -1), is_causal=bool(attributes.get("is_causal", 1)),
        head_sink=t.get("head_sink"), k_scale=t.get("k_scale"), v_scale=t.get("v_scale"))
    return out.numpy(), kc.numpy(), vc.numpy()
