"""LoRA adapters in the TensorRT path, up to the TensorRT calls (docs/tensorrt.md: written, never run): the plugin
graph prepared with the branch (AutoCast, onnx.checker), the profiles covering every LoRA input in step with
input_ids, the engine check comparing each adapter against ONNX Runtime's LoRA reference (the engine's runner stood in
by ONNX Runtime), and TrtRunner binding a step's stacks and masks over stand-ins for TensorRT and cuda-python."""

from __future__ import annotations

import sys

import numpy as np
import onnx
import pytest

from lora_build import SPEC, two_adapters
from trt_stand_ins import Cuda, tensorrt


@pytest.fixture(scope="module")
def plugin_build(tiny_checkpoints, tmp_path_factory):
    """The tiny Llama exported for TensorRT (the plugin graph), two adapters, and the spec."""
    from llmc.compiler import build
    from llmc.compiler.spec import parse_spec

    checkpoint = tiny_checkpoints["llama"]
    root = tmp_path_factory.mktemp("trt-lora")
    spec = parse_spec({"name": "t", "source": str(checkpoint), "target": "tensorrt", "precision": "fp16", **SPEC,
                       "adapters": two_adapters(checkpoint, root)})
    result = build(spec, output=root / "out", until="export")
    return result.spec, result.exported, root / "out" / "export", checkpoint


def _lora(plugin_build):
    from llmc.compiler.source import inspect_source
    from llmc.compiler.tensorrt.stage import engine_lora

    spec, exported, folder, _ = plugin_build
    return engine_lora(spec, inspect_source(spec.source), exported, folder)


def test_the_plan_skips_verify_adapters_for_the_plugin_graph(plugin_build):
    from llmc.compiler.pipeline.plan import plan_build

    spec = plugin_build[0]
    assert "verify-adapters" not in plan_build(spec).stages  # the tensorrt stage checks them on the engine


def test_the_prepared_graph_takes_the_lora_inputs_in_fp16_and_every_input_has_a_profile(plugin_build, tmp_path):
    from onnx import TensorProto

    from llmc.compiler.tensorrt.prep import prepare_for_tensorrt
    from llmc.compiler.tensorrt.profiles import profile_shapes, profiles
    from llmc.compiler.tensorrt.split_kv import SplitBuffers

    spec, exported, folder, _ = plugin_build
    lora = _lora(plugin_build)
    assert set(lora.adapters) == {"a", "b"} and lora.sites and all(s.rows is None for s in lora.sites)
    split = SplitBuffers(spec.limits.max_seq_len, exported.model.head_dim)
    path = prepare_for_tensorrt(folder / exported.onnx, "fp16", tmp_path / "prep", lora.sites, split)
    onnx.checker.check_model(str(path), full_check=True)
    model = onnx.load(str(path), load_external_data=False)
    inputs = {i.name: i for i in model.graph.input}
    lora_inputs = [n for n in inputs if n.startswith("lora")]
    assert len(lora_inputs) == 2 * len(lora.sites) + 2  # A and B per site, the masks of 1 and 3 modules
    assert all(inputs[n].type.tensor_type.elem_type == TensorProto.FLOAT16 for n in lora_inputs)
    assert len(inputs["lora_mask_x3"].type.tensor_type.shape.dim) == 3
    built = profiles(spec.limits, exported.model.num_kv_heads, exported.model.head_dim, (), lora.runner,
                     split.shapes())
    for profile in built:
        shapes = profile_shapes(profile, list(inputs))  # every network input has a shape
        ids = shapes["input_ids"]
        for k in range(3):  # min, opt, max: a mask row per token, widths from 0 to every slot at the highest rank
            assert shapes["lora_mask_x3"][k][:2] == ids[k]
        site = next(s for s in lora.sites if len(s.members) == 3)
        a = shapes[f"lora.{site.name}.a"]
        assert [w[1] for w in a] == [0, 3 * spec.lora.max_rank, 3 * spec.lora.max_slots * spec.lora.max_rank]
        assert [w[2] for w in shapes["lora_mask_x3"]] == [w[1] for w in a]


def test_the_engine_check_compares_each_adapter_with_the_lora_reference(plugin_build, monkeypatch, tmp_path):
    """verify_engine on the plugin build's adapters, the engine's runner stood in by ONNX Runtime over the same
    reference LoRA graph: every case passes and the summary names each adapter; arrays that are not the adapter's
    (one scaled) fail it."""
    from llmc.compiler.source import inspect_source, load_model
    from llmc.compiler.tensorrt import stage, verify_engine
    from llmc.runtime.runners.ort import OrtRunner

    spec, exported, folder, _ = plugin_build
    lora = _lora(plugin_build)
    model, tokenizer = load_model(inspect_source(spec.source))
    reference = verify_engine.reference_graph(exported, folder, exported, model, tokenizer, tmp_path / "ref", "h")
    spec = spec.model_copy(update={"verify": spec.verify.model_copy(update={"decode_steps": 6})})

    def check(scale: float) -> str:
        def stand_in(plans, layout, info, lora=None, **sizes):  # the "engine": ONNX Runtime over the LoRA reference
            return _Scaled(OrtRunner(plans[0], layout, max_batch=sizes["max_batch"], capacity=sizes["capacity"],
                                     lora=lora[0]), scale)

        with stage._lora_reference(reference, lora, model, tmp_path) as (ref, with_sites):
            assert ref[0] != reference[0] and with_sites.reference_sites
            monkeypatch.setattr(verify_engine, "engine_runner", lambda plans, layout, info, lora=None, **sizes:
                                stand_in([ref[0]], reference[1], info, (with_sites.reference_sites, 0, 0), **sizes))
            return verify_engine.verify_engine([tmp_path / "model.plan"], reference[1], None, ref, tokenizer,
                                               exported.model.vocab_size, spec, lora=with_sites)

    summary = check(1.0)
    assert "adapter a: greedy tokens 100% equal" in summary and "adapter b: greedy tokens 100% equal" in summary
    from llmc.errors import VerifyError

    with pytest.raises(VerifyError, match=r"adapter a: .*FAILED"):
        check(3.0)


class _Scaled:
    """A runner whose adapters' B arrays are multiplied by `scale` (what wrong adapter arrays in an engine give)."""

    def __init__(self, runner, scale):
        self.runner, self.scale = runner, scale
        self.rows, self.capacity, self.layout = runner.rows, runner.capacity, runner.layout

    def step(self, *args, adapters=None, **kwargs):
        from llmc.runtime.lora.stacks import AdapterWeights

        if adapters is not None and self.scale != 1.0:
            adapters = [None if a is None else AdapterWeights(a.ref, a.rank, {k: (x, y * self.scale) for k, (x, y)
                                                                               in a.sites.items()}) for a in adapters]
        return self.runner.step(*args, adapters=adapters, **kwargs)

    def close(self):
        self.runner.close()


def test_the_trt_runner_binds_a_steps_stacks_once_per_set_and_its_masks_each_step(plugin_build, monkeypatch,
                                                                                 tmp_path):
    from llmc.runtime.layout import KVLayout
    from llmc.runtime.lora.stacks import AdapterRef, AdapterWeights
    from llmc.runtime.runners import trt as trt_runner

    lora = _lora(plugin_build)
    shapes, cuda = {}, Cuda()
    monkeypatch.setitem(sys.modules, "tensorrt", tensorrt([], shapes))
    monkeypatch.setattr(trt_runner, "_cuda", lambda: cuda)
    monkeypatch.setattr(trt_runner, "gpu_identity", lambda: ("NVIDIA H100", 90))
    (tmp_path / "model.plan").write_bytes(b"plan")
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", in_place=True)
    runner = trt_runner.TrtRunner(tmp_path / "model.plan", layout, max_batch=4, capacity=64, max_num_tokens=32,
                                  lora=lora.runner)
    a, b = lora.adapters["a"], lora.adapters["b"]
    site = next(s for s in lora.sites if len(s.members) == 3)

    def lora_copies():
        return [c for c in cuda.copies if c[0] in runner._lora_buffers.values()]

    runner.step(np.array([[1, 2, 3]]), np.array([0]), first_row=0)  # base only: stacks zero slots wide
    assert shapes["lora_mask_x3"] == (1, 3, 0) and shapes[f"lora.{site.name}.a"] == (site.in_features, 0)
    cuda.copies.clear()
    runner.step(np.array([[1], [2]]), np.array([3, 0]), first_row=0, adapters=[a, b])  # two slots at rank 8
    assert shapes["lora_mask_x3"] == (2, 1, 2 * 3 * 8) and shapes[f"lora.{site.name}.a"] == (site.in_features, 48)
    first = len(lora_copies())
    assert first == len(runner._lora_buffers)  # every stack and mask copied
    cuda.copies.clear()
    runner.step(np.array([[4], [5]]), np.array([4, 1]), first_row=0, adapters=[b, a])  # the same set: masks only
    assert len(lora_copies()) == 2
    with pytest.raises(ValueError, match="3 rows got 1 adapters"):
        runner.step(np.array([[1], [2], [3]]), np.array([0, 0, 0]), adapters=[a])
    other = AdapterWeights(AdapterRef("c", "0" * 64), 4, {})
    runner.step(np.array([[1]]), np.array([0]), adapters=[other])  # an adapter on no site: zeros, still bound
    runner.close()
    assert not cuda.live  # every LoRA buffer freed with the rest
