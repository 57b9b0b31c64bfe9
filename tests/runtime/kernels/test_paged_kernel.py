"""llmc.PagedAttention on CPU (runtime/paged_attention*.c, the op in runtime/kernels/paged_attention/paged_attention_op.c) computes
what plugins/op/attention.py's reference_paged_attention computes, on every instruction set this CPU runs
(AVX512, AVX2, the portable loops), over block sizes, GQA ratios, head sizes, rows at different positions,
chunked prefill, rotary, float16 and int8 caches (per-tensor and per-channel scales), slot mappings, unmapped
blocks, windows and softcap, in place (IO binding one buffer to a cache's input and output) and copied.
Attention sinks, partial rotary and the features combined: test_paged_features.py."""

import numpy as np
import onnxruntime as ort
import pytest

from llmc.plugins.op import paged_schema
from llmc.runtime.kernels import cpu_kernels

from paged_cases import case, paged_model, reference

ISAS = cpu_kernels.paged_isas()
FLOAT, INT8, FLOAT16 = 1, 3, 10
CACHE_TYPES = {np.dtype(np.float32): FLOAT, np.dtype(np.float16): FLOAT16, np.dtype(np.int8): INT8}


def session(feeds, heads, kv_heads, isa, threads=2, **attributes):
    head_size = feeds["key_cache"].shape[3]
    extra = [(name, 6, list(feeds[name].shape)) for name in ("slot_mapping",) if name in feeds]
    extra += [(name, FLOAT, list(feeds[name].shape)) for name in ("head_sink", "k_scale", "v_scale") if name in feeds]
    if "k_scale" in feeds:
        quant = "PER_CHANNEL" if feeds["k_scale"].size > 1 else "PER_TENSOR"
        attributes = {"k_quant_type": quant, "v_quant_type": quant, "k_cache_dtype": "int8", **attributes}
    model = paged_model(paged_schema.LLMC_DOMAIN, CACHE_TYPES[feeds["key_cache"].dtype],
                        heads=heads, kv_heads=kv_heads, head_size=head_size, blocks=feeds["key_cache"].shape[0],
                        block_size=feeds["key_cache"].shape[1], rotary="cos_cache" in feeds,
                        rotary_dim=2 * feeds["cos_cache"].shape[1] if "cos_cache" in feeds else None,
                        packed="key" not in feeds, extra_inputs=extra, isa=isa, threads=threads, **attributes)
    if "cos_cache" in feeds:  # the tables and the queries are float32 whatever the cache holds
        for value in model.graph.input:
            if value.name in ("cos_cache", "sin_cache", "query", "key", "value"):
                value.type.tensor_type.elem_type = FLOAT
        model.graph.output[0].type.tensor_type.elem_type = FLOAT
    for value in (*model.graph.input, model.graph.output[0]):
        if value.name in ("query", "key", "value", "output", "k_scale", "v_scale", "cos_cache", "sin_cache",
                          "head_sink"):
            value.type.tensor_type.elem_type = FLOAT
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.register_custom_ops_library(str(cpu_kernels.paged_library()))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def run(feeds, heads, kv_heads, isa, *, in_place=False, **attributes):
    """The kernel's (output, key cache, value cache); in place: each cache bound as its input and output."""
    sess = session(feeds, heads, kv_heads, isa, **attributes)
    if not in_place:
        return sess.run(None, feeds)
    caches = {n: feeds[n].copy() for n in ("key_cache", "value_cache")}
    binding = sess.io_binding()
    binding.bind_output("output")
    for name, value in feeds.items():
        if name not in caches:
            binding.bind_cpu_input(name, value)
    for name, array in caches.items():
        value = ort.OrtValue.ortvalue_from_numpy(array)
        binding.bind_ortvalue_input(name, value)
        binding.bind_ortvalue_output(name + "_out", value)
    sess.run_with_iobinding(binding)
    return binding.copy_outputs_to_cpu()[0], caches["key_cache"], caches["value_cache"]


def check(feeds, heads, kv_heads, isa, in_place=False, **attributes):
    got = run(feeds, heads, kv_heads, isa, in_place=in_place, **attributes)
    want = reference(feeds, heads, kv_heads, **attributes)
    tolerance = 2e-5 if feeds["key_cache"].dtype == np.float32 else 2e-3  # the kernel folds int8 scales elsewhere
    np.testing.assert_allclose(got[0], want[0], rtol=tolerance, atol=tolerance)
    for g, w in zip(got[1:], want[1:]):
        np.testing.assert_array_equal(g, w)  # the same values written to the same slots, the rest untouched


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (9, 3), (8, 1)])
def test_rows_at_different_positions(isa, block_size, heads, kv_heads):
    """Decode rows and a prefill chunk continuing a cached prefix in one call, lengths straddling block
    boundaries, blocks scattered through the pool (stale data everywhere else); head size 64."""
    rows = [(0, 1), (block_size - 1, 1), (37, 1), (2 * block_size + 3, 19), (0, 7)]
    check(case(rows, heads, kv_heads, 64, block_size, seed=block_size + heads), heads, kv_heads, isa)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fp16", [False, True])
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("head_size, interleaved", [(64, 0), (80, 1), (24, 0)])
def test_rotary_caches_and_head_sizes(isa, fp16, in_place, head_size, interleaved):
    """Rotary (rotate-half and interleaved) on a long chunked-prefill row and decode rows, float32 and float16
    caches, in place and copied; head sizes 64, 80 (AVX512's loops take it too) and 24 (a tail for AVX512)."""
    rows = [(100, 40), (5, 1), (63, 1)]
    feeds = case(rows, 6, 2, head_size, 16, seed=head_size, rotary=True, fp16=fp16)
    check(feeds, 6, 2, isa, in_place=in_place, rotary_interleaved=interleaved)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("quant", ["PER_TENSOR", "PER_CHANNEL"])
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("head_size", [64, 24])
def test_int8_caches(isa, quant, in_place, head_size):
    """int8 caches under the contract's scales: the new keys (rotated) and values written as the reference's
    codes (round to nearest even, saturated: some values fall outside the scales' range), attention over the
    codes times their scales; GQA, chunked prefill and decode rows, head sizes 64 and 24 (AVX512's tail)."""
    feeds = case([(100, 40), (5, 1), (63, 1), (0, 9)], 6, 2, head_size, 16, seed=head_size, rotary=True, int8=quant)
    check(feeds, 6, 2, isa, in_place=in_place)


def test_int8_scales_matter():
    """The output follows the scales: doubling v_scale and the new values (the same codes written) doubles the
    output, and a per-channel k_scale differs from its mean used per tensor."""
    feeds = case([(30, 1), (12, 3)], 4, 2, 16, 8, seed=5, int8="PER_CHANNEL")
    out = run(feeds, 4, 2, ISAS[0])[0]
    doubled = {**feeds, "v_scale": feeds["v_scale"] * 2, "value": feeds["value"] * 2}
    np.testing.assert_allclose(run(doubled, 4, 2, ISAS[0])[0], 2 * out, rtol=1e-5, atol=1e-5)
    flat = {**feeds, "k_scale": feeds["k_scale"].mean().reshape(1), "v_scale": feeds["v_scale"].mean().reshape(1)}
    assert not np.allclose(run(flat, 4, 2, ISAS[0])[0], out, atol=1e-3)
    check(flat, 4, 2, ISAS[0])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("attributes", [{"local_window_size": 9}, {"softcap": 1.5, "scale": 0.3}, {"is_causal": 0},
                                        {"is_causal": 0, "local_window_size": 5}])
def test_window_softcap_and_non_causal(isa, attributes):
    feeds = case([(20, 6), (0, 3), (31, 1)], 8, 2, 32, 8, seed=3)
    check(feeds, 8, 2, isa, **attributes)


@pytest.mark.parametrize("isa", ISAS)
def test_packed_qkv_slot_mapping_and_unmapped_blocks(isa):
    """Packed QKV; a slot mapping that skips two tokens' writes (-1: a prefix-cache hit) and sends one to a
    spare block; a block-table entry unmapped (-1) and one out of range, both masked out of attention."""
    rows = [(10, 4), (3, 2)]
    feeds = case(rows, 4, 2, 16, 4, seed=7, packed=True)
    table = feeds["block_table"]
    derived = [table[0, p // 4] * 4 + p % 4 for p in range(10, 14)] + [table[1, p // 4] * 4 + p % 4 for p in (3, 4)]
    spare = np.setdiff1d(np.arange(feeds["key_cache"].shape[0]), table)[0]
    feeds["slot_mapping"] = np.array([-1, derived[1], -1, derived[3], derived[4], spare * 4 + 2], np.int32)
    table[0, 0], table[0, 1] = -1, 1000
    check(feeds, 4, 2, isa)


def test_many_threads_few_rows_split_by_head():
    """One decode row on 8 threads (the kernel splits a GQA group into single heads) and a long row alone."""
    for rows in ([(300, 1)], [(0, 200)]):
        feeds = case(rows, 9, 3, 64, 16, seed=11)
        got = run(feeds, 9, 3, ISAS[0], threads=8)
        np.testing.assert_allclose(got[0], reference(feeds, 9, 3)[0], rtol=2e-5, atol=2e-5)


def test_make_session_registers_the_library_for_paged_graphs(tmp_path):
    """A stored graph with an llmc.PagedAttention node opens through make_session (the library registered,
    the node given the session's threads) and computes what the reference does."""
    from llmc.runtime.runners.ort import make_session

    feeds = case([(5, 3), (0, 1)], 4, 2, 16, 4, seed=2)
    model = paged_model(paged_schema.LLMC_DOMAIN, FLOAT, heads=4, kv_heads=2, head_size=16,
                        blocks=feeds["key_cache"].shape[0], block_size=4)
    (tmp_path / "paged.onnx").write_bytes(model.SerializeToString())
    got = make_session(tmp_path / "paged.onnx", num_threads=2).run(None, feeds)
    np.testing.assert_allclose(got[0], reference(feeds, 4, 2)[0], rtol=2e-5, atol=2e-5)


def test_refusals_name_what_is_not_implemented(tmp_path):
    """Inputs and attributes the CPU kernel does not implement fail at session creation, bad lengths at
    run time, each error naming the input or attribute."""
    from llmc.runtime.runners.ort import make_session

    norm = paged_model(paged_schema.LLMC_DOMAIN, FLOAT, extra_inputs=[("q_norm_weight", FLOAT, [8])])
    (tmp_path / "norm.onnx").write_bytes(norm.SerializeToString())
    with pytest.raises(ValueError, match="q_norm_weight is not implemented"):
        make_session(tmp_path / "norm.onnx")
    feeds = case([(2, 2)], 4, 2, 8, 4)
    for attributes, message in (({"kv_cache_layout": "LATENT"}, "kv_cache_layout 'LATENT'"),
                                ({"k_quant_type": "PER_TENSOR"}, "k_quant_type 'PER_TENSOR' needs an int8 cache"),
                                ({"k_cache_dtype": "int8"}, "k_cache_dtype 'int8' does not name"),
                                ({"isa": "sse9"}, "isa 'sse9'")):
        with pytest.raises(Exception, match=message):
            session(feeds, 4, 2, **{"isa": ISAS[-1], **attributes})
    sess = session(feeds, 4, 2, ISAS[-1])
    too_long = {**feeds, "past_seqlens": np.array([feeds["block_table"].shape[1] * 4], np.int32)}
    with pytest.raises(Exception, match="row 0: .* do not fit its block table"):
        sess.run(None, too_long)
    with pytest.raises(Exception, match="cumulative_sequence_length runs from 0 to 3"):
        sess.run(None, {**feeds, "cumulative_sequence_length": np.array([0, 3], np.int32)})


def test_int8_refusals_name_the_scale_or_attribute():
    """An int8 cache needs a PER_TENSOR or PER_CHANNEL quant type and scales of the shape it names."""
    feeds = case([(2, 2)], 4, 2, 8, 4, int8="PER_CHANNEL")
    with pytest.raises(Exception, match="k_quant_type 'NONE': an int8 cache takes PER_TENSOR or PER_CHANNEL"):
        session(feeds, 4, 2, ISAS[-1], k_quant_type="NONE")
    sess = session(feeds, 4, 2, ISAS[-1], v_quant_type="PER_TENSOR")
    with pytest.raises(Exception, match=r"v_scale is not \[1\] \(PER_TENSOR\)"):
        sess.run(None, feeds)
    flat = {**feeds, "k_scale": np.ones(1, np.float32)}
    sess = session(flat, 4, 2, ISAS[-1], k_quant_type="PER_CHANNEL", v_quant_type="PER_CHANNEL")
    with pytest.raises(Exception, match=r"k_scale is not \[kv_num_heads, 1, head_size\] \(PER_CHANNEL\)"):
        sess.run(None, flat)


def test_half_conversion_rounds_as_numpy_does():
    """The float16 cache's writes: paged_float_to_half against numpy over every rounding case (ties, subnormals,
    overflow, infinities)."""
    import ctypes

    lib = ctypes.CDLL(str(cpu_kernels.paged_library()))
    lib.paged_float_to_half.argtypes, lib.paged_float_to_half.restype = [ctypes.c_float], ctypes.c_uint16
    lib.paged_half_to_float.argtypes, lib.paged_half_to_float.restype = [ctypes.c_uint16], ctypes.c_float
    rng = np.random.default_rng(0)
    values = np.concatenate([rng.standard_normal(2000).astype(np.float32) * 10.0 ** rng.integers(-8, 6, 2000),
                             np.float16(np.arange(0, 65504, 977, dtype=np.float32)).astype(np.float32) + 0.5 ** 12,
                             np.array([65504, 65519, 65520, 1e9, np.inf, -np.inf, 2 ** -25, 2 ** -24 * 1.5, -0.0],
                                      np.float32)])
    got = np.array([lib.paged_float_to_half(float(v)) for v in values], np.uint16)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(got, values.astype(np.float16).view(np.uint16))
    halves = np.arange(0, 65536, 7, dtype=np.uint16)
    halves = halves[~np.isnan(halves.view(np.float16))]
    np.testing.assert_array_equal(np.array([lib.paged_half_to_float(int(h)) for h in halves], np.float32),
                                  halves.view(np.float16).astype(np.float32))
