"""Weight-only codes: what blockwise packs is what MatMulNBits computes with, the activation-weighted
search and AWQ's scale search never do worse than round to nearest, sibling MatMulNBits merge."""

import numpy as np
import pytest

@pytest.mark.parametrize("bits,k,symmetric", [(4, 64, False), (4, 96, False), (4, 80, False), (8, 64, False),
                                               (8, 80, False), (8, 80, True), (4, 96, True)])
def test_packed_codes_are_what_matmulnbits_computes_with(bits, k, symmetric):
    """blockwise.pack's layout read by ONNX Runtime's kernel (odd block counts and a K that is not a
    multiple of the block included) gives exactly x @ the codes' dequantized weight; symmetric codes
    go without zero points (the kernel's default, 2^(bits-1))."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from llmc.compiler.quantize.blockwise import minmax, pack, search

    rng = np.random.default_rng(bits + k)
    w = rng.standard_normal((k, 6)).astype(np.float32)
    w[3, 0] = 9.0
    importance = rng.random(k) + 0.1
    q = search(w, importance, bits, 32, symmetric)
    names = ("B", "scales", "zero_points")[:2 if symmetric else 3]
    inits = [numpy_helper.from_array(a, name) for a, name in zip(pack(q), names)]
    node = helper.make_node("MatMulNBits", ["x", *names], ["y"], domain="com.microsoft",
                            K=k, N=6, bits=bits, block_size=32, accuracy_level=0)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 6])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    x = rng.standard_normal((3, k)).astype(np.float32)
    y = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(y, x @ q.dequantize(), rtol=1e-5, atol=1e-5)
    weighted = [float((importance[:, None] * np.square(c.dequantize() - w)).sum())
                for c in (q, minmax(w, bits, 32, symmetric))]
    assert weighted[0] <= weighted[1]  # never worse than round to nearest over the block's range
    if symmetric:
        assert q.symmetric and (q.zero_points == 2 ** (bits - 1)).all()
    else:
        assert np.abs(q.dequantize() - w).max() < 1.3 * np.ptp(w) / (2**bits - 1)  # within a (searched) code step


def test_sibling_matmul_nbits_are_merged_into_one_with_the_same_outputs():
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from llmc.compiler.quantize.blockwise import minmax, pack
    from llmc.compiler.graph.passes import merge_sibling_matmul_nbits

    rng = np.random.default_rng(4)
    nodes, inits = [], []
    for name, k, n, source in (("gate", 64, 24, "x"), ("up", 64, 40, "x"), ("down", 64, 8, "x2"), ("other", 64, 8, "x2")):
        arrays = pack(minmax(rng.standard_normal((k, n)).astype(np.float32), 4, 32))
        inits += [numpy_helper.from_array(a, f"{name}.{r}") for a, r in zip(arrays, ("B", "s", "z"))]
        level = 4 if name != "other" else 0  # a different accuracy level: not merged with "down"
        nodes.append(helper.make_node("MatMulNBits", [source, f"{name}.B", f"{name}.s", f"{name}.z"], [name],
                                      domain="com.microsoft", K=k, N=n, bits=4, block_size=32, accuracy_level=level))
    nodes.insert(0, helper.make_node("Neg", ["x"], ["x2"]))
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("gate", "up", "down", "other")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])], outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    x = rng.standard_normal((2, 64)).astype(np.float32)

    def run(m):
        return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})

    before = run(model)
    assert merge_sibling_matmul_nbits(model.graph) == 1
    assert [n.op_type for n in model.graph.node] == ["Neg", "MatMulNBits", "Split", "MatMulNBits", "MatMulNBits"]
    assert not any(t.name.startswith(("gate.", "up.")) for t in model.graph.initializer)
    for a, b in zip(before, run(model)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("k,n,bits,block,symmetric", [(100, 70, 4, 32, False), (96, 130, 8, 128, True),
                                                     (64, 64, 4, 32, True), (33, 5, 8, 16, False),
                                                     (256, 200, 4, 64, False)])
def test_the_c_search_picks_exactly_the_numpy_codes(k, n, bits, block, symmetric):
    """blockwise_search.c against the NumPy loop it replaces (50x slower): the same codes, scales and zero
    points bit for bit, with the importance (search) and without (minmax), and the same fake-quantized
    weights with AWQ's row scale; K past the last full block,
    columns past the last group of 64, rows of very different ranges."""
    from llmc.compiler.quantize import blockwise

    rng = np.random.default_rng(k + n)
    w = (rng.standard_normal((k, n)) * rng.random((k, 1)) * 3).astype(np.float32)
    w[:, 1] = 0.0  # a constant column: every block's range is empty
    importance = (rng.random(k) ** 3).astype(np.float32)
    for h in (importance, None):
        c = blockwise.blockwise_search_c(w, h, bits, block, symmetric)
        assert c is not None, "no C compiler here: the build host of the tests has one (cc)"
        for got, want in zip(c, blockwise.search_numpy(w, h, bits, block, symmetric)):
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_array_equal(got, want)
    s = (rng.random(k) + 0.5).astype(np.float32)  # AWQ's row scale: Q(w * s) / s in one pass
    want = blockwise.minmax(w * s[:, None], bits, block, symmetric).dequantize() / s[:, None]
    np.testing.assert_array_equal(blockwise.fake_quantize(w, bits, block, symmetric, row_scale=s), want)
    out = np.full_like(w, np.nan)  # a reused buffer: every entry written, the same values
    assert blockwise.fake_quantize(w, bits, block, symmetric, row_scale=s, out=out) is out
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("symmetric", [False, True])
def test_scales_are_fp16_values_where_fp16_holds_them(symmetric):
    """The scales search and minmax pick (in C and in NumPy alike) are fp16 values, so llmc's 4-bit kernel packs
    them in half the bytes; a block whose scale fp16 would make subnormal (a range of 1e-6) or infinite (1e6)
    keeps its float32 scale, and round to nearest still reconstructs each block within half its step (symmetric:
    a step, less the clipped top code)."""
    from llmc.compiler.quantize import blockwise

    rng = np.random.default_rng(11)
    w = rng.standard_normal((96, 70)).astype(np.float32)
    w[:, 3] *= 1e-6
    w[:, 4] *= 1e6
    importance = (rng.random(96) + 0.1).astype(np.float32)
    for codes in (blockwise.search(w, importance, 4, 32, symmetric), blockwise.minmax(w, 4, 32, symmetric),
                  blockwise.BlockCodes(*blockwise.search_numpy(w, importance, 4, 32, symmetric), 96, 4, symmetric)):
        scales = codes.scales[:, 0, :]
        with np.errstate(over="ignore"):  # the 1e6 column's scales: inf in fp16
            as_half = scales.astype(np.float16).astype(np.float32)
        normal = np.ones(70, bool)
        normal[[3, 4]] = False
        np.testing.assert_array_equal(scales[:, normal], as_half[:, normal])
        assert not np.array_equal(scales[:, ~normal], as_half[:, ~normal])
    steps = np.ptp(w.reshape(3, 32, 70), axis=1) / 15  # round to nearest within half a step of its range's
    error = np.abs(blockwise.minmax(w, 4, 32, symmetric).dequantize() - w).reshape(3, 32, 70).max(1)
    assert (error <= (0.55 if not symmetric else 1.9) * steps).all()  # symmetric clips the top code


def test_without_a_c_compiler_the_search_runs_in_numpy(monkeypatch):
    from llmc.compiler.quantize import blockwise

    rng = np.random.default_rng(5)
    w, h = rng.standard_normal((64, 8)).astype(np.float32), rng.random(64).astype(np.float32)
    fast = blockwise.search(w, h, 4, 32)
    s = (rng.random(64) + 0.5).astype(np.float32)
    fast_rounded = blockwise.fake_quantize(w, 4, 32, row_scale=s)
    monkeypatch.setenv("CC", "no-such-compiler")
    blockwise._search_library.cache_clear()
    try:
        assert blockwise._search_library() is None
        slow = blockwise.search(w, h, 4, 32)
        out = np.full_like(w, np.nan)
        assert blockwise.fake_quantize(w, 4, 32, row_scale=s, out=out) is out
    finally:
        blockwise._search_library.cache_clear()
    np.testing.assert_array_equal(out, fast_rounded)
    for a, b in ((fast.codes, slow.codes), (fast.scales, slow.scales), (fast.zero_points, slow.zero_points)):
        np.testing.assert_array_equal(a, b)


def test_weighted_search_puts_the_accuracy_where_the_activations_are():
    from llmc.compiler.quantize.blockwise import minmax, search

    rng = np.random.default_rng(3)
    w = rng.standard_normal((64, 40)).astype(np.float32)
    importance = np.ones(64)
    importance[[5, 37]] = 1e4  # two outlier input channels, as in real activations

    def weighted_error(q):
        return float((importance[:, None] * np.square(q.dequantize() - w)).sum())

    searched, plain = search(w, importance, 4, 32), minmax(w, 4, 32)
    assert weighted_error(searched) < 0.5 * weighted_error(plain)
    assert np.abs(searched.dequantize()[[5, 37]] - w[[5, 37]]).max() < np.abs(plain.dequantize()[[5, 37]] - w[[5, 37]]).max()
    assert searched.codes.max() <= 15 and searched.zero_points.max() <= 15
    symmetric = search(w, importance, 4, 32, symmetric=True)  # the scale alone: zero points stay at 8
    assert (symmetric.zero_points == 8).all()
    assert weighted_error(symmetric) < 0.5 * weighted_error(minmax(w, 4, 32, symmetric=True))


def test_awq_search_never_does_worse_than_round_to_nearest():
    from llmc.compiler.quantize.awq import search_scale
    from llmc.compiler.quantize.blockwise import fake_quantize

    rng = np.random.default_rng(1)
    x = rng.standard_normal((128, 64)).astype(np.float32)
    x[:, [3, 17]] *= 40  # two outlier channels, as in real activations
    w = rng.standard_normal((64, 48)).astype(np.float32)
    s, alpha = search_scale(x, [w], bits=4, block=32)
    rtn = np.square(x @ w - x @ fake_quantize(w, 4, 32)).sum()
    scaled = np.square(x @ w - (x / s) @ fake_quantize(w * s[:, None], 4, 32)).sum()
    assert alpha > 0 and scaled < 0.9 * rtn


def test_awq_scores_a_wide_weight_on_sampled_columns_and_picks_what_all_of_them_pick():
    from llmc.compiler.quantize.awq import sampled_columns, search_scale

    rng = np.random.default_rng(2)
    x = rng.standard_normal((128, 64)).astype(np.float32)
    x[:, [3, 17, 40]] *= 30
    wide = rng.standard_normal((64, 4096)).astype(np.float32)
    narrow = 8 * rng.standard_normal((64, 48)).astype(np.float32)
    narrow[[3, 17, 40]] *= 0.02  # alone it wants alpha 1.0, the wide one 0.4: together, the sample's share decides
    sample, share = sampled_columns(wide, 512)
    again, _ = sampled_columns(wide, 512)
    assert sample.shape == (64, 512) and share == 8.0 and np.array_equal(sample, again)  # a seeded draw
    columns = [int(np.flatnonzero((wide == c[:, None]).all(0))[0]) for c in sample.T[:8]]
    assert len(set(columns)) == 8  # distinct columns of the weight, not copies of one
    whole, one = sampled_columns(narrow, 512)
    assert whole is narrow and one == 1.0
    s_all, alpha_all = search_scale(x, [wide, narrow], bits=4, block=32, columns=4096)
    s_some, alpha_some = search_scale(x, [wide, narrow], bits=4, block=32, columns=512)
    assert alpha_all == alpha_some == 0.5 and np.array_equal(s_all, s_some)  # unweighed, the sample picks 0.6
