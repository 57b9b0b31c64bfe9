"""LoRA on a mixture's experts end to end: the tiny Qwen3-MoE built with two PEFT adapters (A: the attention
projections and both expert parameters; B: down_proj's experts alone, another rank, rsLoRA, a rank_pattern), served
by the engine as Triton's model loads it. Each adapter's greedy tokens equal PEFT's generate, a mixed batch equals
each request alone, an adapter loaded at run time gets the build's bytes, and an int4 build (experts quantized to
QMoE) serves them too."""

from __future__ import annotations

import numpy as np
import pytest

from lora_build import SPEC, engine_greedy, make_adapter, peft_greedy

PROMPTS = [[5, 17, 99, 3, 42, 200, 7, 8, 9, 10, 11, 12], [11, 12, 13, 14, 60, 61]]
MAX_TOKENS = 10
ADAPTERS = {"a": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
            "b": dict(r=8, lora_alpha=16, use_rslora=True, target_parameters=["mlp.experts.down_proj"],
                      rank_pattern={r"layers\.0\.mlp\.experts\.down_proj": 2})}


@pytest.fixture(scope="module")
def built(tiny_checkpoints, tmp_path_factory):
    from llmc.compiler import build
    from llmc.compiler.repository.package import VERSION
    from llmc.compiler.spec import parse_spec

    root = tmp_path_factory.mktemp("lora-experts")
    checkpoint = tiny_checkpoints["qwen3_moe"]
    adapters = {name: make_adapter(checkpoint, root / name, seed, **config)
                for seed, (name, config) in enumerate(ADAPTERS.items(), 1)}
    spec = parse_spec({"name": "tiny_moe", "source": str(checkpoint), **SPEC,
                       "adapters": {k: str(v) for k, v in adapters.items()}})
    build(spec, output=root / "out")
    return root / "out" / "model_repository" / "tiny_moe" / VERSION, adapters


def _generate(engine, requests):
    return engine_greedy(engine, requests, MAX_TOKENS)


def test_the_engine_serves_expert_adapters_as_peft_generates(built, tiny_checkpoints):
    from llmc.runtime.manifest import RepositoryManifest
    from llmc.runtime.serving.loader import load

    version, adapters = built
    experts = [s for s in RepositoryManifest.load(version).lora.sites if s.experts]
    assert sorted(s.name for s in experts) == ["experts.0.fc1", "experts.0.fc2", "experts.2.fc1", "experts.2.fc2"]
    assert {s.experts for s in experts} == {6} and all(s.interleave == s.name.endswith("fc1") for s in experts)
    runs = [(PROMPTS[0], None), (PROMPTS[0], "a"), (PROMPTS[0], "b"), (PROMPTS[1], "b")]
    # PEFT loads target_parameters adapters side by side only when they target the same parameters: one each
    want = [peft_greedy(tiny_checkpoints["qwen3_moe"], {name or "a": adapters[name or "a"]}, [(ids, name)],
                        MAX_TOKENS)[0] for ids, name in runs]
    assert len({tuple(w) for w in want[:3]}) == 3 and all(len(set(w)) > 1 for w in want)
    engine = load(version)[0]
    try:
        assert _generate(engine, runs) == want
        assert [_generate(engine, [run])[0] for run in runs] == want
    finally:
        engine.close()


def test_an_expert_adapter_loaded_at_run_time_gets_the_builds_bytes(built):
    from llmc.fleet.adapters import Served, convert
    from llmc.fleet.localstore import LocalStore
    from llmc.runtime.lora.files import parse_adapter

    version, adapters = built
    served = Served.read(LocalStore(version.parents[1]), "tiny_moe")
    for info in served.manifest.lora.adapters:
        loaded = parse_adapter(convert(served, f"{info.name}2", adapters[info.name]), info.name)
        file = parse_adapter((version / info.file).read_bytes(), info.name)
        assert loaded.sites.keys() == file.sites.keys() and any(s.startswith("experts.") for s in file.sites)
        for site, (a, b) in file.sites.items():
            assert np.array_equal(loaded.sites[site][0], a) and np.array_equal(loaded.sites[site][1], b), site


def test_an_int4_build_serves_expert_adapters_over_its_qmoe_experts(built, tiny_checkpoints, tmp_path):
    """int4-weight-only (AWQ, the default) makes the experts QMoE: the LoRA graph runs llmc.MoeLoraQ over their codes
    for the adapter tokens (the node on the rest), and a mixed batch equals each request alone, each adapter its own
    tokens."""
    import onnx

    from llmc.compiler import build
    from llmc.compiler.repository.package import VERSION
    from llmc.compiler.spec import parse_spec
    from llmc.runtime.manifest import RepositoryManifest
    from llmc.runtime.serving.loader import load

    spec = parse_spec({"name": "q", "source": str(tiny_checkpoints["qwen3_moe"]), **SPEC,
                       "quantization": {"mode": "int4-weight-only"},  # AWQ: its dense layer's scaling folded
                       "adapters": {k: str(v) for k, v in built[1].items()}})
    build(spec, output=tmp_path / "out")
    version = tmp_path / "out" / "model_repository" / "q" / VERSION
    graph = onnx.load(str(version / RepositoryManifest.load(version).lora.lora_file), load_external_data=False)
    assert [n.name for n in graph.graph.node if n.op_type == "MoeLoraQ"] == ["lora/experts.0/MoeLoraQ",
                                                                        "lora/experts.2/MoeLoraQ"]
    runs = [(PROMPTS[0], None), (PROMPTS[0], "a"), (PROMPTS[0], "b"), (PROMPTS[1], "b")]
    engine = load(version)[0]
    try:
        mixed = _generate(engine, runs)
        assert [_generate(engine, [run])[0] for run in runs] == mixed
    finally:
        engine.close()
    assert len({tuple(m) for m in mixed[:3]}) == 3 and all(len(set(m)) > 1 for m in mixed)
