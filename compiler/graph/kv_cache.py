"""`export.kv_cache_dtype`: the paged graph's block pools in float16 or int8 instead of float32.

The pools are graph inputs that flow only into the llmc.PagedAttention nodes and back out as their
aliased outputs, so the element type is a property of the exported graph, set after the export by
retyping those inputs and outputs (`retype_pools`); the kernel has a registration per cache type
(runtime/kernels/paged_attention/paged_attention_op.c).

int8 follows ONNX Runtime's PagedAttention contract: symmetric codes, dequantization scales as the
node's `k_scale`/`v_scale` inputs. Those are static, so the build measures them (`pool_scales`):
the exported decoder runs in PyTorch on calibration text (the built-in corpus's calibration half;
seeded random tokens for a checkpoint without a tokenizer) with float32 pools, and each layer's
scale is, per KV head and channel (`PER_CHANNEL`, shape [kv_heads, 1, head_dim]), the largest
magnitude its cache received, over 127. Keys are stored rotated, and a rotated channel's value
depends on the position; rotate-half keeps the norm of each channel pair (i, i + rotary_dim / 2),
so both channels of a pair get the largest pair norm seen, a bound that holds at every position.
Values get VALUE_HEADROOM over their peak: a peak seen on 1,024 calibration tokens (what the built-in
text gives) undershoots new text's, and values beyond it saturate. Measured on SmolLM2 (docs/build.md):
scales from half the calibration windows, tried on the other half, round values with least error at
1.25-1.5x the peak (relative error 3.1% at 1x, 1.7% at 1.25x, 1.4% at 1.5x) and keys at 1-1.1x; with all
windows, the held-out text's values 2.1% at 1x, 1.4% at 1.25x and 1.5x (saturating 1e-3 -> 1e-4 of them),
keys 0.66% at 1x, 0.76% at 1.25x. Larger values still saturate at +-127 (or -128).
"""

from __future__ import annotations

import numpy as np

from llmc.compiler.spec.sections import KVCacheDtype
from llmc.runtime.layout import KVLayout

ELEMENT = {KVCacheDtype.fp32: "float32", KVCacheDtype.fp16: "float16", KVCacheDtype.int8: "int8"}
CALIBRATION_WINDOWS, CALIBRATION_TOKENS = 8, 256  # up to 2,048 tokens (the built-in text has 4 windows)
CALIBRATION_BLOCK = 16
VALUE_HEADROOM = 1.25  # value scales: their calibration peak times this, over 127


def calibration_windows(tokenizer, vocab_size: int) -> list[np.ndarray]:
    """The token windows the int8 scales are measured on."""
    if tokenizer is None:
        rng = np.random.default_rng(0)
        return [rng.integers(0, vocab_size, CALIBRATION_TOKENS) for _ in range(CALIBRATION_WINDOWS)]
    from llmc.compiler.textdata import builtin_documents, token_windows

    return token_windows(tokenizer, builtin_documents("calibration"), CALIBRATION_TOKENS, CALIBRATION_WINDOWS,
                         "export.kv_cache_dtype", "the built-in calibration text")


def pool_scales(decoder, layout: KVLayout, windows: list[np.ndarray], rotary_dim: int) -> np.ndarray:
    """int8 scales [num_layers, 2 (key, value), kv_heads, 1, head_dim]: the decoder (compiler/models/)
    run on each window with float32 pools, each cache's peak per head and channel (values': times
    VALUE_HEADROOM) over 127."""
    import torch

    from llmc.compiler.paged_decoder import PagedDecoder

    module = PagedDecoder(decoder).eval()
    peaks = torch.zeros(layout.num_layers, 2, layout.num_kv_heads, layout.head_dim)
    half = rotary_dim // 2
    for window in windows:
        n = len(window)
        blocks = -(-n // CALIBRATION_BLOCK)
        pools = tuple(torch.zeros(blocks, CALIBRATION_BLOCK, layout.num_kv_heads, layout.head_dim)
                      for _ in range(2 * layout.num_layers))
        with torch.no_grad():
            out = module(torch.as_tensor(window, dtype=torch.int64), torch.arange(n), torch.tensor([0, n], dtype=torch.int32),
                         torch.zeros(1, dtype=torch.int32), torch.arange(blocks, dtype=torch.int32)[None],
                         torch.tensor([n - 1]), pools)
        for i, pool in enumerate(out[1:]):
            x = pool.reshape(-1, layout.num_kv_heads, layout.head_dim)[:n].abs()
            if i % 2 == 0 and half:  # keys: each rotary pair's norm, the bound at every position
                norm = torch.sqrt(x[..., :half] ** 2 + x[..., half:2 * half] ** 2)
                x = torch.cat([norm, norm, x[..., 2 * half:]], dim=-1)
            peaks[i // 2, i % 2] = torch.maximum(peaks[i // 2, i % 2], x.amax(dim=0))
    scales = torch.clamp(peaks, min=1e-8) / 127.0
    scales[:, 1] *= VALUE_HEADROOM
    return scales[:, :, :, None, :].numpy().astype(np.float32)


def retype_pools(proto, layout: KVLayout, scales: np.ndarray | None) -> None:
    """Give the graph's pools (past inputs, present outputs) `layout.dtype`, in place; for int8, give each
    llmc.PagedAttention node its layer's scales as initializers `kv_scale.{i}.key|value` (PER_CHANNEL)."""
    from onnx import helper, numpy_helper

    elem = helper.np_dtype_to_tensor_dtype(np.dtype(layout.dtype))
    pools = set(layout.past_names()) | set(layout.present_names())
    for value in (*proto.graph.input, *proto.graph.output, *proto.graph.value_info):
        if value.name in pools:
            value.type.tensor_type.elem_type = elem
    pasts = layout.past_names()
    for node in proto.graph.node:
        if node.op_type != "PagedAttention":
            continue
        assert node.input[3] in pasts, f"{node.name}: key cache {node.input[3]!r} is not a graph input"
        layer = pasts.index(node.input[3]) // 2
        attributes = {"k_cache_dtype": layout.dtype, "v_cache_dtype": layout.dtype}
        if layout.dtype == "int8":
            assert scales is not None, "int8 pools need their scales"
            names = [f"kv_scale.{layer}.key", f"kv_scale.{layer}.value"]
            for name, scale in zip(names, scales[layer]):
                proto.graph.initializer.append(numpy_helper.from_array(scale, name))
            node.input.extend([""] * (14 - len(node.input)))
            node.input.extend(names)
            attributes.update(k_quant_type="PER_CHANNEL", v_quant_type="PER_CHANNEL")
        kept = [a for a in node.attribute if a.name not in attributes]  # the lowering may state the defaults
        del node.attribute[:]
        node.attribute.extend([*kept, *(helper.make_attribute(k, v) for k, v in attributes.items())])
