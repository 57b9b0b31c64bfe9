"""Adapters on an int4 base built with AWQ (the weight-only modes' default), end to end: the quantize stage records
what its scaling did (quantize/channel_scales.py), the package stage folds it into every adapter's file and writes
the fold beside the site table, an adapter loaded at run time (llmc/fleet/adapters.py) gets the same fold, and the
engine serves it. That the fold itself makes the branch equal PEFT is tests/compiler/lora/test_awq_fold.py's (on an
unrounded scaled export, where PEFT is exact); here the recorded scales are checked against the graph they describe:
each norm's weight in the export over the served graph's is the scale its readers' adapters are folded with."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from lora_build import ADAPTER_A, SPEC, make_adapter

PROMPT = [5, 17, 99, 3, 42, 200, 7, 8, 9, 10]


@pytest.fixture(scope="module")
def awq_build(tiny_checkpoints, tmp_path_factory):
    from llmc.compiler import build
    from llmc.compiler.repository.package import VERSION
    from llmc.compiler.spec import parse_spec

    root = tmp_path_factory.mktemp("lora-awq")
    adapter = make_adapter(tiny_checkpoints["llama"], root / "a", 1, **ADAPTER_A)
    spec = parse_spec({"name": "tiny_awq", "source": str(tiny_checkpoints["llama"]), **SPEC,
                       "quantization": {"mode": "int4-weight-only"}, "adapters": {"a": str(adapter)}})
    build(spec, output=root / "out")
    return root / "out", root / "out" / "model_repository" / "tiny_awq" / VERSION, adapter


def test_the_recorded_scales_are_the_graphs_and_fold_every_adapter_file(awq_build):
    from llmc.compiler.lora import read_adapter
    from llmc.compiler.lora.fold import Fold
    from llmc.compiler.lora.stacks import site_arrays
    from llmc.compiler.quantize.channel_scales import FILENAME, ChannelScales
    from llmc.runtime.lora.files import parse_adapter
    from llmc.runtime.manifest import RepositoryManifest

    out, version, folder = awq_build
    lora = RepositoryManifest.load(version).lora
    assert lora.scales_file == "lora_scales.safetensors"
    fold = Fold.from_bytes((version / lora.scales_file).read_bytes(), lora.scales_file)
    recorded = Fold.of(lora.sites, ChannelScales.load(out / "quantize" / FILENAME))
    assert fold.a_rows.keys() == recorded.a_rows.keys() and fold.b_columns.keys() == recorded.b_columns.keys()
    # the tiny Llama's 2 layers: q/k/v and gate/up read the norms' outputs, down the up projection's scaled columns;
    # the untied LM head (adapter A targets it) the final norm's
    assert len(fold.a_rows) == 2 * 4 + 1 and "lm_head" in fold.a_rows and len(fold.b_columns) == 2

    export = onnx.load(str(out / "export" / "model.onnx"))
    served = onnx.load(str(out / "quantize" / "model.onnx"))
    before, after = ({t.name: onnx.numpy_helper.to_array(t) for t in g.graph.initializer} for g in (export, served))
    export_nodes = {n.name: n for n in export.graph.node}
    by_x = {site.x: site.name for site in lora.sites}
    checked = 0
    for node in served.graph.node:
        if node.op_type in ("SimplifiedLayerNormalization", "RMSNormalization", "SkipSimplifiedLayerNormalization") \
                and node.output[0] in by_x:
            slot = 2 if node.op_type.startswith("Skip") else 1
            ratio = before[export_nodes[node.name].input[slot]] / after[node.input[slot]]
            assert np.allclose(ratio, fold.a_rows[by_x[node.output[0]]], rtol=1e-5), node.name
            checked += 1
    assert checked == 2 * 2 + 1  # each layer's two norms (attention's and the MLP's) and the final norm

    file = parse_adapter((version / lora.adapters[0].file).read_bytes(), "a")
    want = site_arrays(lora.sites, read_adapter("a", folder, max_rank=lora.max_rank), fold)
    unfolded = site_arrays(lora.sites, read_adapter("a", folder, max_rank=lora.max_rank))
    for site, (a, b) in want.sites.items():
        assert np.array_equal(file.sites[site][0], a) and np.array_equal(file.sites[site][1], b), site
    assert any(not np.allclose(file.sites[s][0], unfolded.sites[s][0]) for s in fold.a_rows)


def test_an_adapter_loaded_at_run_time_is_folded_as_the_build_folds_it(awq_build):
    from llmc.fleet.adapters import Served, convert
    from llmc.fleet.localstore import LocalStore
    from llmc.runtime.lora.files import parse_adapter

    _, version, folder = awq_build
    served = Served.read(LocalStore(version.parents[1]), "tiny_awq")
    loaded = parse_adapter(convert(served, "a2", folder), "a2")
    built = parse_adapter((version / served.manifest.lora.adapters[0].file).read_bytes(), "a")
    assert loaded.sites.keys() == built.sites.keys()
    for site, (a, b) in built.sites.items():
        assert np.array_equal(loaded.sites[site][0], a) and np.array_equal(loaded.sites[site][1], b), site


def test_the_engine_serves_the_adapter_over_the_awq_base(awq_build):
    from llmc.runtime.decoding.sampling import SamplingParams
    from llmc.runtime.serving.loader import load

    engine = load(awq_build[1])[0]
    try:
        def run(requests):
            out: dict[str, list[int]] = {}
            for i, name in enumerate(requests):
                engine.add_request(f"r{i}", PROMPT, SamplingParams(max_tokens=8, temperature=0.0), adapter=name)
            while engine.has_work:
                for o in engine.step():
                    out.setdefault(o.request_id, []).extend(o.token_ids)
            return [out[f"r{i}"] for i in range(len(requests))]

        mixed = run([None, "a"])
        assert mixed[0] != mixed[1] and len(set(mixed[1])) > 1
        assert run(["a"]) == [mixed[1]] and run([None]) == [mixed[0]]
    finally:
        engine.close()
