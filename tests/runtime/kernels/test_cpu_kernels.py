"""llmc's CPU kernel (runtime/matmul_nbits4*.c, the op in runtime/kernels/cpu_kernels.c): llmc.MatMulNBits4
computes what ONNX Runtime's MatMulNBits computes on every instruction set this CPU has, and
make_session swaps it in only where it applies."""

import ctypes
import mmap
import os
import platform

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from llmc.runtime.kernels import cpu_kernels, graph_edits
from llmc.runtime.runners.ort import make_session

KERNELS = cpu_kernels.load()
needs_kernel = pytest.mark.skipif(KERNELS is None, reason="llmc's CPU kernel needs AVX2 + FMA or AVX512-VNNI, and a "
                                                          "C compiler (see the log)")
ISAS = KERNELS.isas if KERNELS else ("avx2",)  # every kernel this CPU runs (AVX512 hosts run both)


def _model(k: int, n: int, *, zero_points: bool = True, rank: int = 2, half_scales: bool = False, block: int = 32,
           **attrs) -> onnx.ModelProto:
    """One MatMulNBits over random 4-bit codes, blocks of `block` (scales and zero points random too;
    `half_scales`: scales that are fp16 values, as llmc's quantizer writes them, which the kernel packs as fp16)."""
    rng = np.random.default_rng(k * 1000 + n)
    blocks = (k + block - 1) // block
    scales = (rng.random(n * blocks, dtype=np.float32) + 0.1) * 0.02
    if half_scales:
        scales = scales.astype(np.float16).astype(np.float32)
    inits = [numpy_helper.from_array(rng.integers(0, 256, (n, blocks, block // 2), dtype=np.uint8), "B"),
             numpy_helper.from_array(scales, "scales")]
    if zero_points:
        inits.append(numpy_helper.from_array(rng.integers(0, 256, n * ((blocks + 1) // 2), dtype=np.uint8), "zp"))
    attributes = {"K": k, "N": n, "bits": 4, "block_size": block, "accuracy_level": 4, **attrs}
    node = helper.make_node("MatMulNBits", ["A", "B", "scales", *(["zp"] if zero_points else [])], ["Y"],
                            domain="com.microsoft", **attributes)
    lead = ["rows"] if rank == 2 else ["batch", "rows"]
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [*lead, k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [*lead, n])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])


def _session(model: onnx.ModelProto, library=None) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    if library is not None:
        options.register_custom_ops_library(str(library))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("k, n, zero_points", [(576, 40, True), (128, 576, True), (1536, 33, False), (64, 16, True),
                                               (192, 7, True), (4096, 210, True)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 12, 13, 21, 29])
@pytest.mark.parametrize("half_scales", [False, True], ids=["fp32-scales", "fp16-scales"])
@pytest.mark.parametrize("block", [32, 64, 128])
def test_llmc_kernel_computes_what_matmulnbits_computes(isa, k, n, zero_points, rows, half_scales, block):
    """Every path of the kernel (one to four rows a tile, more rows in turns over chunks of columns (K 4096: a
    thread's 105 columns in chunks of 48, 48 and 9), the prefill panel from 20 rows, a tail of rows; K with and
    without a final pair of blocks; N not a multiple of 4, 8 or 16; no zero points; the scales packed as fp32 or,
    when they are fp16 values, as fp16; a scale and zero point a block of 32, 64 or 128 weights, K 192 making
    64's blocks odd in number) against ONNX Runtime's kernel, which quantizes the activations the same way: equal
    to float rounding."""
    if k % block:
        pytest.skip(f"K {k} is not a number of blocks of {block} (MatMulNBits pads it; the kernel leaves such nodes)")
    model = _model(k, n, zero_points=zero_points, half_scales=half_scales, block=block)
    reference = _session(model)
    swapped = onnx.ModelProto.FromString(model.SerializeToString())
    assert graph_edits.accelerate(swapped, 2, isa) == 1 and swapped.graph.node[0].op_type == graph_edits.OP
    ours = _session(swapped, cpu_kernels.library())
    a = np.random.default_rng(rows).standard_normal((rows, k)).astype(np.float32) * 3
    a[0, :40] = 0.0  # an all-zero block: scale 0 on the activation side
    expected, got = reference.run(None, {"A": a})[0], ours.run(None, {"A": a})[0]
    assert got.shape == (rows, n)
    np.testing.assert_allclose(got, expected, rtol=0, atol=2e-5 * np.abs(expected).max())


@needs_kernel
def test_scales_that_are_fp16_values_pack_in_fewer_bytes():
    """The layout the session picks: fp16 scales only when every scale of the layer survives the round trip (one
    that does not, a NaN among them, or an fp32 value between two fp16 ones keeps the layer's scales fp32), and
    those records are a tenth shorter: the bytes a decode step streams."""
    library = ctypes.CDLL(str(cpu_kernels.library()))
    library.q4_half_scales.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    library.q4_packed_bytes.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    library.q4_packed_bytes.restype = ctypes.c_size_t
    fits = (np.random.default_rng(0).random(1000, dtype=np.float32) * 0.02).astype(np.float16).astype(np.float32)

    def half(scales: np.ndarray) -> bool:
        return bool(library.q4_half_scales(scales.ctypes.data, scales.size))

    assert half(fits) and half(np.array([0.0, -0.0, 2.0**-24, 65504.0], np.float32))
    for odd in (np.float32(0.01), np.float32(np.nan), np.float32(2.0**-25), np.float32(65520.0)):
        changed = fits.copy()
        changed[500] = odd
        assert not half(changed), odd
    for zero_points, share, per_quad in ((1, 1, (328, 296)), (0, 1, (320, 288)), (1, 2, (296, 280)),
                                         (1, 4, (280, 272))):
        # K 4096, N 64: 32 quads per column group, 16 column groups; wider blocks: fewer scales a quad
        assert [library.q4_packed_bytes(4096, 64, zero_points, h, share) for h in (0, 1)] == [16 * 32 * b
                                                                                               for b in per_quad]


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows", [1, 29])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_llmc_kernel_sums_the_largest_products_without_overflow(isa, rows, sign):
    """Every weight code 15 against activations that all quantize to +-127: the largest partial sums
    the kernels form (the AVX2 kernel keeps up to eight products of 15 x 127 in an int16 lane)."""
    model = _model(256, 24)
    b = next(t for t in model.graph.initializer if t.name == "B")
    b.CopyFrom(numpy_helper.from_array(np.full((24, 8, 16), 0xFF, np.uint8), "B"))
    swapped = onnx.ModelProto.FromString(model.SerializeToString())
    graph_edits.accelerate(swapped, 2, isa)
    a = np.full((rows, 256), sign * 2.5, np.float32)
    expected = _session(model).run(None, {"A": a})[0]
    got = _session(swapped, cpu_kernels.library()).run(None, {"A": a})[0]
    np.testing.assert_allclose(got, expected, rtol=0, atol=2e-5 * np.abs(expected).max())


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
def test_llmc_kernel_takes_leading_dimensions(isa):
    model = _model(128, 24, rank=3)
    swapped = onnx.ModelProto.FromString(model.SerializeToString())
    graph_edits.accelerate(swapped, 2, isa)
    a = np.random.default_rng(0).standard_normal((2, 7, 128)).astype(np.float32)
    expected = _session(model).run(None, {"A": a})[0]
    got = _session(swapped, cpu_kernels.library()).run(None, {"A": a})[0]
    assert got.shape == (2, 7, 24)
    np.testing.assert_allclose(got, expected, rtol=0, atol=2e-5 * np.abs(expected).max())


@pytest.mark.parametrize("change", [{"bits": 8}, {"block_size": 16}, {"block_size": 256}, {"accuracy_level": 0},
                                    {"K": 96}, {"block_size": 128, "K": 192}])
def test_only_nodes_the_kernel_computes_as_onnxruntime_does_are_swapped(change):
    k = change.get("K", 128)
    attrs = {key: value for key, value in change.items() if key != "K"}
    model = _model(k, 16, **attrs)
    assert graph_edits.accelerate(model, 2, "avx2") == 0 and model.graph.node[0].op_type == "MatMulNBits"


def test_float_zero_points_and_extra_inputs_keep_onnxruntimes_kernel():
    model = _model(128, 16)
    zp = next(t for t in model.graph.initializer if t.name == "zp")
    zp.CopyFrom(numpy_helper.from_array(np.full(16 * 2, 8.0, np.float32), "zp"))
    assert graph_edits.accelerate(model, 2, "avx2") == 0
    model = _model(128, 16)
    model.graph.node[0].input.extend(["g_idx"])
    assert graph_edits.accelerate(model, 2, "avx2") == 0


def _fed(model: onnx.ModelProto, name: str) -> onnx.ModelProto:
    """The model with initializer `name` made a graph input instead (fed at run time, not a constant)."""
    tensor = next(t for t in model.graph.initializer if t.name == name)
    model.graph.initializer.remove(tensor)
    model.graph.input.append(helper.make_tensor_value_info(name, tensor.data_type, list(tensor.dims)))
    return model


@pytest.mark.parametrize("fed", ["B", "scales", "zp"])
def test_weights_that_are_not_initializers_keep_onnxruntimes_kernel(fed):
    """The kernel repacks B, its scales and zero points when the session opens: only constants can be."""
    assert graph_edits.accelerate(_fed(_model(128, 16), fed), 2, "avx2") == 0


@needs_kernel
@pytest.mark.parametrize("fed, when", [("B", "open"), ("scales", "open"), ("zp", "run")])
def test_the_op_refuses_weights_fed_at_run_time_by_name(fed, when):
    """A graph that names llmc.MatMulNBits4 itself over fed weights: B or scales fail the session's creation,
    zero points its first run (an absent optional input and a fed one look alike when the kernel is created)."""
    model = _model(128, 16)
    graph_edits.accelerate(model, 2, ISAS[0])
    model = _fed(model, fed)
    feeds = {"A": np.ones((1, 128), np.float32)}
    feeds.update({t.name: numpy_helper.to_array(t) for t in _model(128, 16).graph.initializer if t.name == fed})
    message = "B and scales must be initializers" if fed != "zp" else "zero_points must be an initializer"
    if when == "open":
        with pytest.raises(Exception, match=message):
            _session(model, cpu_kernels.library())
    else:
        with pytest.raises(Exception, match=message):
            _session(model, cpu_kernels.library()).run(None, feeds)


@needs_kernel
def test_weights_of_the_wrong_size_are_refused_by_name():
    model = _model(128, 16)
    graph_edits.accelerate(model, 2, ISAS[0])
    scales = next(t for t in model.graph.initializer if t.name == "scales")
    scales.CopyFrom(numpy_helper.from_array(np.ones(16 * 4 - 1, np.float32), "scales"))
    with pytest.raises(Exception, match="scales has 63 elements, not the 64 K and N make"):
        _session(model, cpu_kernels.library())


def _biased(k: int, n: int, bias_dims=None) -> onnx.ModelProto:
    """_model's MatMulNBits, then an Add of a float bias [N] (or `bias_dims`): Qwen's q/k/v projection."""
    model = _model(k, n)
    dims = bias_dims or [n]
    bias = np.random.default_rng(n).standard_normal(dims).astype(np.float32)
    model.graph.initializer.append(numpy_helper.from_array(bias, "bias"))
    model.graph.node[0].output[0] = "Y0"
    model.graph.node.append(helper.make_node("Add", ["Y0", "bias"], ["Y"]))
    model.graph.value_info.append(helper.make_tensor_value_info("Y0", TensorProto.FLOAT, ["rows", n]))
    return model


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows", [1, 5, 29])
def test_an_add_of_a_bias_is_folded_into_the_kernel(isa, rows):
    """The Add after a swapped node goes (its bias the kernel's input 5), on the decode tiles and the prefill
    panel alike, and the graph computes what MatMulNBits then Add compute."""
    model = _biased(576, 40)
    swapped = onnx.ModelProto.FromString(model.SerializeToString())
    assert graph_edits.accelerate(swapped, 2, isa) == 1
    assert [n.op_type for n in swapped.graph.node] == [graph_edits.OP]
    assert list(swapped.graph.node[0].input)[4:] == ["", "bias"] and list(swapped.graph.node[0].output) == ["Y"]
    assert not swapped.graph.value_info  # the intermediate's entry went with it
    a = np.random.default_rng(rows).standard_normal((rows, 576)).astype(np.float32)
    expected, got = _session(model).run(None, {"A": a})[0], _session(swapped, cpu_kernels.library()).run(None, {"A": a})[0]
    np.testing.assert_allclose(got, expected, rtol=0, atol=2e-5 * np.abs(expected).max())


def test_an_add_the_kernel_cannot_take_stays():
    """A bias that is not [N], or an output something else reads too, keeps its Add."""
    model = _biased(128, 16, bias_dims=[1, 16])
    assert graph_edits.accelerate(model, 2, "avx2") == 1 and [n.op_type for n in model.graph.node][-1] == "Add"
    model = _biased(128, 16)
    model.graph.output.append(helper.make_tensor_value_info("Y0", TensorProto.FLOAT, ["rows", 16]))
    assert graph_edits.accelerate(model, 2, "avx2") == 1 and [n.op_type for n in model.graph.node][-1] == "Add"


@needs_kernel
def test_make_session_runs_the_stored_graph_on_the_kernel_and_leaves_the_file_alone(tmp_path):
    model = _model(576, 48)
    path = tmp_path / "model.onnx"
    onnx.save(model, str(path))
    before = path.read_bytes()
    swapped = cpu_kernels.prepare(path, ort.SessionOptions())
    assert [n.op_type for n in onnx.ModelProto.FromString(swapped).graph.node] == [graph_edits.OP]
    a = np.random.default_rng(1).standard_normal((3, 576)).astype(np.float32)
    expected = _session(model).run(None, {"A": a})[0]
    got = make_session(path, 2).run(None, {"A": a})[0]
    np.testing.assert_allclose(got, expected, rtol=0, atol=2e-5 * np.abs(expected).max())
    assert path.read_bytes() == before


@needs_kernel
def test_external_data_is_read_from_beside_the_graph_file(tmp_path):
    model = _model(1024, 256)  # B 128 KiB: whole pages the kernel hands back
    a = np.random.default_rng(2).standard_normal((1, 1024)).astype(np.float32)
    expected = _session(model).run(None, {"A": a})[0]
    onnx.save(model, str(tmp_path / "model.onnx"), save_as_external_data=True, location="weights.bin",
              size_threshold=0)
    assert (tmp_path / "weights.bin").stat().st_size > 1024 * 256 // 2
    first = make_session(tmp_path / "model.onnx", 2)
    # the first session's kernel handed the mapped weights' pages back: a second one reads them again
    for session in (first, make_session(tmp_path / "model.onnx", 2), first):
        np.testing.assert_allclose(session.run(None, {"A": a})[0], expected, rtol=0, atol=2e-5 * np.abs(expected).max())


def _resident_kib(path) -> list[int]:
    """Resident KiB of each of this process's mappings of file `path` (/proc/self/smaps)."""
    resident, mapped = [], False
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if "-" in fields[0] and ":" not in fields[0]:  # a mapping's header: address range, ..., path
            mapped = len(fields) > 5 and fields[-1] == str(path)
        elif mapped and fields[0] == "Rss:":
            resident.append(int(fields[1]))
    return resident


def _cached_fraction(path) -> float:
    """The share of file `path`'s pages in the page cache: mincore over a fresh mapping of it, through ctypes
    (Python's mmap module has no mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                             ctypes.c_int, ctypes.c_int, ctypes.c_long]
    size, page = os.path.getsize(path), os.sysconf("SC_PAGE_SIZE")
    with open(path, "rb") as f:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
    pages = (ctypes.c_ubyte * (-(-size // page)))()
    try:
        assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), pages) == 0, ctypes.get_errno()
    finally:
        libc.munmap(ctypes.c_void_p(address), ctypes.c_size_t(size))
    return sum(p & 1 for p in pages) / len(pages)


@needs_kernel
@pytest.mark.skipif(tuple(int(p) for p in platform.release().split(".")[:2] if p.isdigit()) < (5, 4),
                    reason="MADV_PAGEOUT needs Linux 5.4")
def test_the_kernel_hands_back_the_mapped_weights_it_copied(tmp_path):
    """ONNX Runtime maps external-data initializers from the file; once the op has copied B, its scales and zero
    points into its own layout, their pages leave the process (the copy is what stays resident), and the page
    cache: make_session reads the file in before the session opens, not after, when it read them back."""
    data = tmp_path / "model.onnx.data"  # the name a build gives it, which make_session reads in
    onnx.save(_model(4096, 1024), str(tmp_path / "model.onnx"), save_as_external_data=True, location=data.name,
              size_threshold=0)
    with open(data, "rb") as f:  # out of the page cache: what the session reads is all it holds
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    session = make_session(tmp_path / "model.onnx", 2)
    resident = _resident_kib(data)
    if not resident:
        pytest.skip("this ONNX Runtime read the external data instead of mapping it")
    assert sum(resident) < 0.05 * data.stat().st_size / 1024
    assert _cached_fraction(data) < 0.05
    assert session.run(None, {"A": np.ones((1, 4096), np.float32)})[0].shape == (1, 1024)


def test_graphs_without_the_op_open_from_their_file(tmp_path):
    model = _model(128, 16, bits=8)  # not one the kernel takes
    onnx.save(model, str(tmp_path / "m.onnx"))
    assert cpu_kernels.prepare(tmp_path / "m.onnx", ort.SessionOptions()) == str(tmp_path / "m.onnx")


@needs_kernel
def test_an_isa_the_cpu_does_not_run_is_refused_by_name():
    swapped = _model(128, 16)
    graph_edits.accelerate(swapped, 2, "sse2")
    with pytest.raises(Exception, match="isa 'sse2' is not one this CPU runs"):
        _session(swapped, cpu_kernels.library())
