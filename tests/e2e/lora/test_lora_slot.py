"""LoRA adapters on a slot graph (export.attention: fused, the slot engine: the TensorRT target's form, here on ONNX
Runtime): the build adds the branch with masks a row per token ([batch, seq, width]) and verifies each adapter; the slot
engine serves a mixed batch (base, A, B) equal to PEFT's generate, runs base-only steps on the same session, and
refuses an unknown adapter before anything runs."""

from __future__ import annotations

import pytest

from lora_build import SPEC, engine_greedy, peft_greedy, two_adapters

PROMPTS = [[5, 17, 99, 3, 42, 200, 7, 8, 9, 10, 11], [11, 12, 13, 14, 60, 61]]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def built(tiny_checkpoints, tmp_path_factory):
    from llmc.compiler import build
    from llmc.compiler.repository.package import VERSION
    from llmc.compiler.spec import parse_spec

    checkpoint = tiny_checkpoints["llama"]
    root = tmp_path_factory.mktemp("lora-slot")
    adapters = two_adapters(checkpoint, root)
    spec = parse_spec({"name": "tiny_slot", "source": str(checkpoint), **SPEC, "export": {"attention": "fused"},
                       "adapters": adapters})
    out = root / "out"
    build(spec, output=out)
    return out, out / "model_repository" / "tiny_slot" / VERSION, adapters, checkpoint


@pytest.fixture(scope="module")
def engine(built):
    from llmc.runtime.serving.loader import load

    engine = load(built[1])[0]
    yield engine
    engine.close()


def test_the_slot_build_has_per_token_masks_and_verified_its_adapters(built):
    import onnx

    from llmc.compiler.artifacts import AdapterVerifyReport
    from llmc.runtime.manifest import RepositoryManifest

    out, version, _, _ = built
    m = RepositoryManifest.load(version)
    assert not m.kv_layout.paged and m.lora is not None
    graph = onnx.load(str(version / m.lora.lora_file), load_external_data=False)
    masks = {i.name: len(i.type.tensor_type.shape.dim) for i in graph.graph.input if i.name.startswith("lora_mask")}
    assert masks == {"lora_mask": 3, "lora_mask_x3": 3}  # [batch, seq, width]
    assert all(s.rows is None for s in m.lora.sites)  # the slot graph's LM head sees every token
    report = AdapterVerifyReport.load(out / "verify-adapters")
    assert report.passed and "slot" in report.candidate and "fused attention" in report.candidate


def test_a_mixed_batch_on_the_slot_engine_equals_peft(built, engine):
    from llmc.runtime.engine.slot_engine import SlotEngine

    _, _, adapters, checkpoint = built
    assert isinstance(engine, SlotEngine) and engine.runner.lora is not None
    runs = [(PROMPTS[0], None), (PROMPTS[0], "a"), (PROMPTS[1], "b"), (PROMPTS[1], "a")]
    want = peft_greedy(checkpoint, adapters, runs, MAX_TOKENS)
    assert len({tuple(w) for w in want[:2]}) == 2  # adapter A changes the tokens: the comparison can fail
    assert engine_greedy(engine, runs, MAX_TOKENS) == want
    assert engine_greedy(engine, runs[:1], MAX_TOKENS) == want[:1]  # base-only steps, the same session
    assert engine.adapter_users("a") == (0, 0)


def test_an_unknown_adapter_is_refused_before_anything_runs(engine):
    from llmc.runtime.decoding.sampling import SamplingParams
    from llmc.runtime.lora.store import UnknownAdapter

    with pytest.raises(UnknownAdapter, match="nope"):
        engine.add_request("x", [1, 2, 3], SamplingParams(max_tokens=2), adapter="nope")
    assert not engine.has_work


def test_an_adapter_loaded_at_run_time_serves_on_the_slot_engine(built, tiny_checkpoints, tmp_path):
    """The serving loop's adapter admin (runtime/serving/lora_admin.py) on the slot engine: a PEFT adapter converted
    and loaded while serving gives PEFT's greedy tokens."""
    from test_lora_runtime_load import PROMPT, control, generate

    from lora_build import ADAPTER_A, make_adapter
    from llmc.compiler.lora.convert import convert
    from llmc.runtime.decoding.tokenizer import encode, load
    from llmc.runtime.manifest import RepositoryManifest
    from llmc.runtime.serving.loop import ServingLoop

    _, version, _, checkpoint = built
    folder = make_adapter(checkpoint, tmp_path / "c", 10, **ADAPTER_A)
    data = convert("c", folder, RepositoryManifest.load(version).lora)[0]
    want = peft_greedy(checkpoint, {"c": folder}, [(encode(load(version / "tokenizer.json"), PROMPT), "c")], 12)[0]
    loop = ServingLoop.from_manifest(version).start()
    try:
        result, error = control(loop, {"op": "load"}, data)
        assert error is None and result["loaded"] == "c"
        assert generate(loop, lora_name="c", max_tokens=12).wait().ids == want
    finally:
        loop.stop()
