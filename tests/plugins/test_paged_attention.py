"""PagedAttention: the schema is ONNX Runtime's com.microsoft.PagedAttention contract (and llmc's copy admits
float32), the torch reference (plugins/op/attention.py) agrees with llmc::attention's contiguous one, and
llmc's CPU kernel (runtime/paged_attention*.c) computes what the reference computes (test_paged_kernel.py)."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper
from onnxruntime.capi import onnxruntime_pybind11_state as C

from llmc.plugins.op import paged_schema
from llmc.plugins.op.attention import reference_attention, reference_paged_attention
from llmc.plugins.op.lowering import register_schemas

from paged_cases import paged_model

FLOAT16, FLOAT = TensorProto.FLOAT16, TensorProto.FLOAT


def _ort_schema():
    return next(s for s in C.get_all_operator_schema() if s.name == "PagedAttention" and s.domain == "com.microsoft")


def _attribute_default(attribute):
    proto = getattr(attribute, "_default_value", b"")
    return helper.get_attribute_value(onnx.AttributeProto.FromString(proto)) if proto else None


def test_schema_is_onnxruntimes_contract():
    """llmc's com.microsoft schema has exactly ONNX Runtime's inputs, outputs, attributes (defaults and
    required ones) and type constraints; llmc's differs only by admitting float32."""
    register_schemas()
    theirs = _ort_schema()
    for domain in (paged_schema.MICROSOFT_DOMAIN, paged_schema.LLMC_DOMAIN):
        ours = onnx.defs.get_schema("PagedAttention", 1, domain)
        for mine, want in ((ours.inputs, theirs.inputs), (ours.outputs, theirs.outputs)):
            assert [(p.name, p.type_str, p.option.name) for p in mine] == \
                   [(p.name, p.typeStr, p.option.name) for p in want]
        assert {n: (int(a.type), a.required, _attribute_default(a)) for n, a in ours.attributes.items()} == \
               {n: (int(a.type), a.required, _attribute_default(a)) for n, a in theirs.attributes.items()}
        allowed = {c.type_param_str: set(c.allowed_type_strs) for c in ours.type_constraints}
        extra = set() if domain == paged_schema.MICROSOFT_DOMAIN else {"tensor(float)"}
        assert allowed == {c.type_param_str: set(c.allowed_type_strs) | (extra if c.type_param_str in ("T", "T_CACHE")
                                                                             else set())
                           for c in theirs.type_constraints}


@pytest.mark.parametrize("packed", [False, True])
def test_llmc_node_passes_the_checker_in_float32(packed):
    """onnx.checker (full check: shape inference with the registered inference function) accepts a float32
    llmc.PagedAttention graph; the output's hidden size comes out right for packed QKV too."""
    register_schemas()
    model = paged_model(paged_schema.LLMC_DOMAIN, FLOAT, packed=packed, rotary=True)
    onnx.checker.check_model(model, full_check=True)
    del model.graph.output[:]  # inferred, not declared
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    out = next(v for v in inferred.graph.value_info if v.name == "output")
    assert [d.dim_value or d.dim_param for d in out.type.tensor_type.shape.dim] == ["T", 32]


def test_microsoft_node_passes_onnxruntimes_schema_check():
    """An fp16 com.microsoft.PagedAttention graph gets through ONNX Runtime's own type and shape checks; on
    CPU it stops at kernel lookup (CUDA only). A float32 one fails the type check (so the check is real)."""
    register_schemas()
    fp16 = paged_model(paged_schema.MICROSOFT_DOMAIN, FLOAT16, rotary=True)
    onnx.checker.check_model(fp16, full_check=True)
    with pytest.raises(Exception, match="(?i)could not find an implementation"):
        ort.InferenceSession(fp16.SerializeToString(), providers=["CPUExecutionProvider"])
    with pytest.raises(Exception, match="(?i)type"):
        ort.InferenceSession(paged_model(paged_schema.MICROSOFT_DOMAIN, FLOAT).SerializeToString(),
                             providers=["CPUExecutionProvider"])


def contiguous_case(rows, heads, kv_heads, head_size, block_size, seed=0, rotary=False):
    """The same attention problem in llmc::attention's contiguous layout and in the paged one (a shuffled
    block table, stale data in every block), as torch tensors."""
    g = torch.Generator().manual_seed(seed)
    past = torch.tensor([p for p, _ in rows])
    counts = [n for _, n in rows]
    capacity = -(-(max(p for p, _ in rows) + max(counts)) // block_size) * block_size  # room for padded rows
    per_row = capacity // block_size
    blocks = per_row * len(rows) + 2
    kc = torch.randn(blocks, block_size, kv_heads, head_size, generator=g)
    vc = torch.randn(blocks, block_size, kv_heads, head_size, generator=g)
    table = torch.randperm(blocks, generator=g)[:len(rows) * per_row].reshape(len(rows), per_row).to(torch.int32)
    q = torch.randn(sum(counts), heads * head_size, generator=g)
    k = torch.randn(sum(counts), kv_heads * head_size, generator=g)
    v = torch.randn(sum(counts), kv_heads * head_size, generator=g)
    tables = None
    if rotary:
        angles = torch.rand(capacity, head_size // 2, generator=g) * 6
        tables = (angles.cos(), angles.sin())
    cu = torch.tensor([0, *np.cumsum(counts)], dtype=torch.int32)
    return dict(q=q, k=k, v=v, kc=kc, vc=vc, cu=cu, past=past.to(torch.int32), table=table, capacity=capacity,
                counts=counts, tables=tables, heads=heads, kv_heads=kv_heads)


@pytest.mark.parametrize("rows, heads, kv_heads, block_size, rotary", [
    ([(0, 5)], 4, 4, 4, False), ([(3, 1), (0, 6), (9, 3)], 6, 2, 4, True), ([(7, 1), (16, 1)], 8, 1, 8, True)])
def test_reference_matches_llmc_attention(rows, heads, kv_heads, block_size, rotary):
    """The paged reference and llmc::attention's contiguous one agree on the same problem: outputs, and
    every row's cache contents through its block table."""
    c = contiguous_case(rows, heads, kv_heads, 8, block_size, rotary=rotary)
    width = max(c["counts"])
    d = 8
    contiguous = []
    for name, cache in (("kc", c["kc"]), ("vc", c["vc"])):
        gathered = cache[c["table"].long()].reshape(len(rows), c["capacity"], kv_heads, d)
        contiguous.append(gathered.transpose(1, 2).contiguous())
    padded = [torch.zeros(len(rows), width, n, d) for n in (heads, kv_heads, kv_heads)]
    for b, (start, n) in enumerate(zip(c["cu"][:-1].tolist(), c["counts"])):
        for t, x in zip(padded, ("q", "k", "v")):
            t[b, :n] = c[x][start:start + n].reshape(n, -1, d)
    cos, sin = c["tables"] or (None, None)
    want, k_want, v_want = reference_attention(*padded, *contiguous, c["past"].long(), d ** -0.5, cos, sin)
    out, kc, vc = reference_paged_attention(c["q"], c["k"], c["v"], c["kc"].clone(), c["vc"].clone(), c["cu"],
                                            c["past"], c["table"], heads, kv_heads, 0.0, cos, sin)
    for b, (start, n) in enumerate(zip(c["cu"][:-1].tolist(), c["counts"])):
        torch.testing.assert_close(out[start:start + n].reshape(n, heads, d), want[b, :n], rtol=1e-5, atol=1e-5)
        for paged, flat in ((kc, k_want), (vc, v_want)):
            end = rows[b][0] + n
            got = paged[c["table"][b].long()].reshape(c["capacity"], kv_heads, d)[:end].transpose(0, 1)
            torch.testing.assert_close(got, flat[b, :, :end])


@pytest.mark.cuda
@pytest.mark.skipif("CUDAExecutionProvider" not in ort.get_available_providers(), reason="needs onnxruntime-gpu")
def test_microsoft_node_runs_on_cuda_as_the_reference_says():
    """The same contract on ONNX Runtime's CUDA kernel: an fp16 com.microsoft.PagedAttention graph (rows at
    different positions, rotary) matches the reference."""
    from paged_cases import case, reference

    feeds = case([(3, 1), (17, 5)], 4, 2, 64, 16, rotary=True, fp16=True)
    feeds = {k: v.astype(np.float16) if v.dtype == np.float32 else v for k, v in feeds.items()}
    model = paged_model(paged_schema.MICROSOFT_DOMAIN, FLOAT16, head_size=64, blocks=feeds["key_cache"].shape[0],
                        block_size=16, rotary=True)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CUDAExecutionProvider"])
    binding = sess.io_binding()
    binding.bind_output("output")
    for name, value in feeds.items():
        if name.endswith("_cache") and "cos" not in name and "sin" not in name:
            shared = ort.OrtValue.ortvalue_from_numpy(value.copy(), "cuda", 0)
            binding.bind_ortvalue_input(name, shared)
            binding.bind_ortvalue_output(name + "_out", shared)
        else:
            binding.bind_cpu_input(name, value)
    sess.run_with_iobinding(binding)
    want = reference(feeds, 4, 2)[0].astype(np.float32)  # computed in float32 from the same fp16 inputs
    np.testing.assert_allclose(binding.copy_outputs_to_cpu()[0].astype(np.float32), want, rtol=2e-2, atol=2e-2)
