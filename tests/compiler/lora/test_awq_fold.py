"""Adapters over a base AWQ scaled (compiler/lora/fold.py): the export scaled by AWQ's own graph edit
(smoothquant.apply_scales) with per-channel scales drawn far from 1, and no rounding, so the base's function is
unchanged and PEFT over the checkpoint is the exact reference. With the fold, a step mixing adapter A, adapter B and
no adapter equals PEFT's logits at fp32 tolerance; without it the adapters' rows are wrong (the branch reads x / s,
and adds to the up projection's y / s). Llama (the norms' sites and the up projection's output) and Phi-3 (its fused
gate_up_proj: only the up half of one site's columns divided)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from lora_cases import PagedSteps, family_adapters, peft_logits

PROMPT = [5, 17, 99, 3, 42, 200, 7]
TOL = 1e-4


@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_adapters_over_a_scaled_base_equal_peft(family, paged_export, tiny_checkpoints, tmp_path):
    from transformers import AutoModelForCausalLM

    from llmc.compiler.lora import add_lora_branches, find_sites, read_adapter, step_inputs
    from llmc.compiler.lora.fold import Fold
    from llmc.compiler.quantize.handler import gemms_as_matmuls
    from llmc.compiler.quantize.smoothquant import apply_scales, smoothable

    folder, exported = paged_export(family)
    checkpoint = tiny_checkpoints[family]
    model = onnx.load(str(folder / exported.onnx))
    sites = find_sites(model, AutoModelForCausalLM.from_pretrained(checkpoint))  # as the build: on the fp32 export
    gemms_as_matmuls(model.graph)
    smoothing = smoothable(model.graph)
    rng, dims = np.random.default_rng(0), {t.name: t.dims for t in model.graph.initializer}
    scales = [np.exp(rng.normal(0, 1, dims[s.readers[0].input[1]][0])).astype(np.float32) for s in smoothing]
    done = apply_scales(model, smoothing, scales)
    fold = Fold.of(sites, done)
    # every layer's attention input and MLP input, and the down projection's (the up projection's output columns)
    layers = len([s for s in sites if s.name.endswith(("down_proj", "mlp.c_proj"))])
    assert len(fold.b_columns) == layers and len(fold.a_rows) >= 3 * layers - (layers if family == "phi3" else 0)
    if family == "phi3":  # gate_up_proj: the gate half untouched, the up half over s
        columns = next(iter(fold.b_columns.values()))
        half = len(columns) // 2
        assert np.all(columns[:half] == 1) and not np.any(columns[half:] == 1)
    add_lora_branches(model, sites)
    onnx.save(model, str(tmp_path / "scaled_lora.onnx"))

    paths = dict(zip("ab", family_adapters(family, checkpoint, tmp_path)))
    adapters = [read_adapter(name, path, max_rank=16) for name, path in paths.items()]
    rows = [(len(PROMPT), 0), (len(PROMPT), 1), (len(PROMPT), -1)]
    want = peft_logits(checkpoint, paths, [(PROMPT, "a"), (PROMPT, "b"), (PROMPT, None)])
    got = PagedSteps(tmp_path / "scaled_lora.onnx", exported.kv_layout).step(
        [(r, PROMPT) for r in range(3)], step_inputs(sites, adapters, rows, fold))
    for r in range(3):
        assert np.abs(got[r] - want[r]).max() < TOL, f"row {r}: logits differ from PEFT's"
    unfolded = PagedSteps(tmp_path / "scaled_lora.onnx", exported.kv_layout).step(
        [(r, PROMPT) for r in range(3)], step_inputs(sites, adapters, rows))
    for r in range(2):  # the fold is what makes it right: without it each adapter's row is off
        assert np.abs(unfolded[r] - want[r]).max() > 1e-2, f"row {r}: the scaling did not reach the branch"
    assert np.abs(unfolded[2] - want[2]).max() < TOL


def test_the_fold_file_round_trips_and_names_a_bad_one():
    from llmc.compiler.lora.fold import Fold

    fold = Fold({"qkv.0": np.arange(1, 5, dtype=np.float32)}, {"layers.0.mlp.up_proj": np.full(3, 0.5, np.float32)})
    back = Fold.from_bytes(fold.to_bytes(), "f")
    assert back.a_rows.keys() == {"qkv.0"} and np.array_equal(back.a_rows["qkv.0"], fold.a_rows["qkv.0"])
    assert np.array_equal(back.b_columns["layers.0.mlp.up_proj"], fold.b_columns["layers.0.mlp.up_proj"])
    with pytest.raises(ValueError, match="f: not a LoRA scales file"):
        Fold.from_bytes(b"nonsense", "f")
