"""`export.kv_cache_dtype` (compiler/graph/kv_cache.py): the spec refuses it off the paged graph; fp16 and int8
builds of the tiny Llama declare their pools in that type (int8: per-channel scales as initializers,
calibrated so the calibration text's keys and values fit), the memory accounting follows, verify passes
at the dtype's tolerance, and the packaged model serves in process. The int8 graph computes exactly
what the PyTorch decoder computes over int8 pools with the same scales."""

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from checkpoints import TINY_SERVING_SPEC
from serving_rig import RecordingSink, request_inputs
from llmc.compiler import build
from llmc.compiler.spec import parse_spec
from llmc.errors import SpecError
from llmc.runtime.layout import KVLayout
from llmc.runtime.runners.paged import PagedRunner, RowStep
from llmc.runtime.serving.loop import ServingLoop


def _spec(source, dtype, attention="paged", **extra):
    return {"name": "tiny", "source": str(source), "export": {"attention": attention, "kv_cache_dtype": dtype},
            **extra}


@pytest.mark.parametrize(("attention", "extra"), [("fused", {}), ("reference", {}),
                                                  ("auto", {"quantization": {"mode": "int8"}})])  # auto: reference
def test_other_lowerings_refuse_a_non_fp32_cache(tmp_path, attention, extra):
    with pytest.raises((SpecError, ValueError), match="export.kv_cache_dtype: fp16 .* needs export.attention: paged"):
        parse_spec(_spec(tmp_path, "fp16", attention, **extra))
    assert parse_spec(_spec(tmp_path, "fp32", attention, **extra)).export.kv_cache_dtype.value == "fp32"


def test_auto_takes_a_non_fp32_cache_on_onnxruntime(tmp_path):
    spec = parse_spec(_spec(tmp_path, "fp16", "auto"))
    assert spec.attention_lowering == "paged" and spec.export.kv_cache_dtype.value == "fp16"


def test_unknown_dtype_names_the_field(tmp_path):
    with pytest.raises((SpecError, ValueError), match="kv_cache_dtype"):
        parse_spec(_spec(tmp_path, "bf16"))
    assert parse_spec({"name": "t", "source": str(tmp_path)}).export.kv_cache_dtype.value == "fp32"


def test_bytes_per_token_follow_the_dtype():
    sizes = {d: KVLayout.paged_layout(30, 3, 64, dtype=d).bytes_per_token() for d in ("float32", "float16", "int8")}
    assert sizes == {"float32": 46080, "float16": 23040, "int8": 11520}


@pytest.fixture(scope="module", params=["fp16", "int8"])
def kv_build(request, tiny_checkpoints, tmp_path_factory):
    spec = parse_spec(_spec(tiny_checkpoints["llama"], request.param,
                            **{**TINY_SERVING_SPEC, "limits": {**TINY_SERVING_SPEC["limits"], "kv_cache_tokens": 256}}))
    folder = tmp_path_factory.mktemp("kv_" + request.param) / "tiny"
    return request.param, folder, build(spec, output=folder)


def test_graph_pools_and_scales(kv_build):
    dtype, folder, result = kv_build
    element = {"fp16": "float16", "int8": "int8"}[dtype]
    layout = result.exported.kv_layout
    assert layout.dtype == element and result.manifest.kv_layout.dtype == element
    types = {t.name: t.dtype for t in result.exported.inputs + result.exported.outputs}
    assert {types[n] for n in layout.past_names() + layout.present_names()} == {element}
    assert types["logits"] == "float32"
    model = onnx.load(str(folder / "export" / "model.onnx"))
    onnx.checker.check_model(model, full_check=True)
    nodes = [n for n in model.graph.node if n.op_type == "PagedAttention"]
    scales = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer if i.name.startswith("kv_scale.")}
    if dtype == "fp16":
        assert not scales and all(len(n.input) <= 10 for n in nodes)
        return
    assert len(scales) == 2 * layout.num_layers
    assert all(s.shape == (layout.num_kv_heads, 1, layout.head_dim) and (s > 0).all() for s in scales.values())
    for node in nodes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["k_quant_type"] == attrs["v_quant_type"] == b"PER_CHANNEL"
        assert node.input[14].startswith("kv_scale.") and node.input[15].endswith(".value")


def test_verify_passes_and_memory_is_smaller(kv_build):
    dtype, folder, result = kv_build
    assert result.verify and result.verify.tolerance == {"fp16": 0.05, "int8": 0.25}[dtype]
    runner = PagedRunner(folder / "export" / result.exported.onnx, result.exported.kv_layout, num_blocks=16,
                         max_num_tokens=16)
    fp32 = KVLayout.paged_layout(*(getattr(result.exported.kv_layout, f) for f in ("num_layers", "num_kv_heads",
                                                                                  "head_dim")))
    assert runner.nbytes * {"fp16": 2, "int8": 4}[dtype] == 16 * 16 * fp32.bytes_per_token()
    assert runner.pools[0].dtype == np.dtype(result.exported.kv_layout.dtype)


def test_serves_in_process(kv_build):
    _, _, result = kv_build
    loop = ServingLoop.from_manifest(result.repository / "tiny" / "1").start()
    try:
        sinks = [RecordingSink() for _ in range(3)]
        for i, sink in enumerate(sinks):
            loop.submit(request_inputs(f"prompt number {i}", max_tokens=8), sink)
        for sink in sinks:
            assert len(sink.joined("output_ids")) == 8 and not sink.errors
    finally:
        loop.stop()


def _torch_int8_logits(checkpoint, graph, layout, prompt):
    """The PyTorch decoder over int8 pools with the graph's own scales (the reference op quantizing)."""
    import torch

    from llmc.compiler.models import decoder_for
    from llmc.compiler.source import inspect_source, load_model
    from llmc.compiler.spec import SourceSpec
    from llmc.plugins.op.attention import reference_paged_attention

    model = load_model(inspect_source(SourceSpec(path=checkpoint)))[0]
    with torch.no_grad():
        fp32 = model(torch.tensor([prompt])).logits[0].numpy()
    decoder = decoder_for(model).eval()
    scales = {i.name: torch.from_numpy(numpy_helper.to_array(i).copy()) for i in graph.initializer
              if i.name.startswith("kv_scale.")}
    layer = iter(range(layout.num_layers))
    n, blocks = len(prompt), -(-len(prompt) // 16)
    cu, past, table = torch.tensor([0, n], dtype=torch.int32), torch.zeros(1, dtype=torch.int32), \
        torch.arange(blocks, dtype=torch.int32)[None]

    def attend(q, k, v, k_cache, v_cache, spec, tables, sink=None):  # compiler/models/base.py's Attend
        i, (_, t, heads, d), kv_heads = next(layer), q.shape, k.shape[2]
        out, k_cache, v_cache = reference_paged_attention(
            q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1), k_cache, v_cache, cu, past, table, heads, kv_heads,
            spec.scale, *tables, softcap=spec.softcap, local_window_size=spec.window, head_sink=sink,
            k_scale=scales[f"kv_scale.{i}.key"], v_scale=scales[f"kv_scale.{i}.value"])
        return out.view(1, t, heads, d), k_cache, v_cache

    pools = [torch.zeros(blocks, 16, layout.num_kv_heads, layout.head_dim, dtype=torch.int8)
             for _ in range(layout.num_layers)]
    with torch.no_grad():
        hidden, _, _ = decoder.body(torch.tensor([prompt]), torch.arange(n)[None], attend, pools,
                                    [p.clone() for p in pools])
        return decoder.head(hidden)[0].numpy(), fp32


def test_int8_graph_is_the_decoder_over_int8_pools(kv_build, tiny_checkpoints):
    """Every prompt position's logits from the int8 graph equal the PyTorch decoder run through the reference
    op with int8 pools and the same scales (and differ from the fp32 model's: the codes are in effect)."""
    dtype, folder, result = kv_build
    if dtype != "int8":
        pytest.skip("the int8 build's check")
    layout = result.exported.kv_layout
    prompt = np.random.default_rng(3).integers(0, 256, 40).tolist()
    runner = PagedRunner(folder / "export" / result.exported.onnx, layout, num_blocks=8, max_num_tokens=64)
    got = runner.step([RowStep(prompt, 0, list(range(3)), num_logits=len(prompt))])
    graph = onnx.load(str(folder / "export" / "model.onnx")).graph
    want, fp32 = _torch_int8_logits(tiny_checkpoints["llama"], graph, layout, prompt)
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)
    assert np.abs(got - fp32).max() > 1e-2


def _blocks(layout, tokens):
    return list(range(-(-tokens // layout.block_size)))


def test_a_prefill_reads_its_own_tokens_back_from_the_cache(kv_build):
    """The perplexity path (quality.perplexity: one prefill through PagedSlots) computes what serving's decode
    computes: each prompt position's logits equal the same tokens fed in chunks of 5 and one at a time, so an
    in-chunk token is attended through the same stored (rounded) key and value a later step reads back. A kernel
    attending to its own chunk's keys and values at full precision would make whole-window perplexity blind to the
    cache's rounding, while decode pays it."""
    from llmc.runtime.runners.paged_slots import slot_runner

    _, folder, result = kv_build
    layout, path = result.exported.kv_layout, folder / "export" / result.exported.onnx
    prompt = np.random.default_rng(5).integers(0, 256, 37)
    slots = slot_runner(path, layout, max_batch=1, capacity=len(prompt))
    whole = slots.step(prompt[None], np.zeros(1, dtype=np.int64))[0]
    slots.close()
    for chunk in (5, 1):
        runner = PagedRunner(path, layout, num_blocks=len(_blocks(layout, len(prompt))), max_num_tokens=len(prompt))
        fed = [runner.step([RowStep(prompt[i:i + chunk].tolist(), i, _blocks(layout, len(prompt)),
                                    num_logits=len(prompt[i:i + chunk]))]) for i in range(0, len(prompt), chunk)]
        runner.close()
        np.testing.assert_allclose(np.concatenate(fed), whole, atol=1e-4, rtol=0)


def _float_pools(checkpoint, layout, window):
    """The PyTorch decoder's float32 keys and values for one window: [layers, 2, tokens, kv_heads, head_dim]."""
    import torch

    from llmc.compiler.models import decoder_for
    from llmc.compiler.paged_decoder import PagedDecoder
    from llmc.compiler.source import inspect_source, load_model
    from llmc.compiler.spec import SourceSpec

    model = load_model(inspect_source(SourceSpec(path=checkpoint)))[0]
    module, n = PagedDecoder(decoder_for(model)).eval(), len(window)
    blocks = len(_blocks(layout, n))
    pools = tuple(torch.zeros(blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
                  for _ in range(2 * layout.num_layers))
    with torch.no_grad():
        out = module(torch.as_tensor(window, dtype=torch.int64), torch.arange(n), torch.tensor([0, n], dtype=torch.int32),
                     torch.zeros(1, dtype=torch.int32), torch.arange(blocks, dtype=torch.int32)[None],
                     torch.tensor([n - 1]), pools)
    flat = [p.reshape(-1, layout.num_kv_heads, layout.head_dim)[:n].numpy() for p in out[1:]]
    return np.stack(flat).reshape(layout.num_layers, 2, n, layout.num_kv_heads, layout.head_dim)


def test_int8_scales_fit_the_calibration_text(kv_build, tiny_checkpoints):
    """The graph's int8 scales fit the calibration text's float keys and values (the PyTorch decoder's): nothing
    exceeds 127 steps (the scales reach each channel's peak) and they are no looser than meant: each rotary key
    pair's largest norm is 127 steps, each value channel's largest magnitude 127 / VALUE_HEADROOM steps. The first layer's
    stored codes (its inputs are the float model's; later layers see int8 attention before them) are those values
    rounded. A scale in the wrong layer, head, channel or cache, or a rotary pair taken wrongly, breaks one of these."""
    from llmc.compiler.graph import kv_cache
    from llmc.compiler.models import decoder_for
    from llmc.compiler.source import inspect_source, load_model, load_tokenizer
    from llmc.compiler.spec import SourceSpec

    dtype, folder, result = kv_build
    if dtype != "int8":
        pytest.skip("the int8 build's check")
    layout, info = result.exported.kv_layout, inspect_source(SourceSpec(path=tiny_checkpoints["llama"]))
    graph = onnx.load(str(folder / "export" / "model.onnx")).graph
    scales = np.stack([[numpy_helper.to_array(i) for i in graph.initializer if i.name == f"kv_scale.{layer}.{kind}"][0]
                       for layer in range(layout.num_layers) for kind in ("key", "value")])[:, :, 0]
    scales = scales.reshape(layout.num_layers, 2, 1, layout.num_kv_heads, layout.head_dim)
    half = decoder_for(load_model(info)[0]).rope.rotary_dim // 2
    peaks = np.zeros((layout.num_layers, 2, layout.num_kv_heads, layout.head_dim))
    for window in kv_cache.calibration_windows(load_tokenizer(info), result.exported.model.vocab_size):
        table = _blocks(layout, len(window))
        runner = PagedRunner(folder / "export" / result.exported.onnx, layout, num_blocks=len(table),
                             max_num_tokens=len(window))
        runner.step([RowStep(window.tolist(), 0, table)])
        codes = [p.reshape(-1, layout.num_kv_heads, layout.head_dim)[:len(window)] for p in runner.pools[:2]]
        runner.close()
        steps = _float_pools(tiny_checkpoints["llama"], layout, window) / scales  # [layers, 2, tokens, kv_heads, d]
        assert (np.abs(np.stack(codes) - steps[0]) <= 0.501).all()
        steps = np.abs(steps)
        if half:  # keys: a rotary pair's norm
            norm = np.sqrt(steps[:, 0, ..., :half] ** 2 + steps[:, 0, ..., half:2 * half] ** 2)
            steps[:, 0, ..., :2 * half] = np.concatenate([norm, norm], axis=-1)
        peaks = np.maximum(peaks, steps.max(axis=2))
    np.testing.assert_allclose(peaks[:, 0], 127, rtol=1e-4)
    np.testing.assert_allclose(peaks[:, 1], 127 / kv_cache.VALUE_HEADROOM, rtol=1e-4)
