"""Adapters over an int4 base against PEFT over the served weights dequantized (issue 54's correctness for an int4
base), for both weight-only algorithms: round to nearest, and AWQ, whose scaling the adapters' arrays fold
(compiler/lora/fold.py).

The served graph's MatMulNBits compute with int8 activations (accuracy_level 4), which PyTorch cannot match; the
test's copy runs them at accuracy_level 0 (ONNX Runtime dequantizes to fp32; llmc's own 4-bit kernel takes level 4
only), so the base is exactly its dequantized weights. Those weights are read from the graph itself, not from the
quantizer: each site's projection (MatMulNBits, and the Split of a merged gate/up) is cut out of the graph and run on
the identity. AWQ's recorded scales map them back to the checkpoint's coordinates (rows over the input's scale, the
up projection's columns times its output's), and they replace the weights of the model PEFT wraps, the LM head's too
(adapter A targets it: PEFT loads A's copy of the head's weight, replaced after the load). A step mixing adapter A,
adapter B and no adapter then equals PEFT row for row at fp32 tolerance; the base row checks the reading of the
weights itself."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from lora_cases import PagedSteps, family_adapters, model_logits, peft_model

PROMPT = [5, 17, 99, 3, 42, 200, 7]
TOL = 1e-4


def served_map(path, x: str, y: str, width: int) -> tuple[np.ndarray, np.ndarray]:
    """(W [in, out], bias [out]) of the graph at `path` from tensor `x` to `y`: that part cut out and run on the
    identity and on zeros."""
    import onnxruntime as ort

    cut = path.with_name(f"cut-{len(list(path.parent.glob('cut-*')))}.onnx")
    onnx.utils.extract_model(str(path), str(cut), [x], [y])
    session = ort.InferenceSession(str(cut), providers=["CPUExecutionProvider"])
    rank = len(session.get_inputs()[0].shape)
    feed = np.eye(width, dtype=np.float32).reshape((1,) * (rank - 2) + (width, width))
    ones, zeros = (session.run(None, {x: f})[0].reshape(width, -1) for f in (feed, np.zeros_like(feed)))
    return ones - zeros, zeros[0]


@pytest.mark.parametrize("algorithm", ["rtn", "awq"])
def test_adapters_over_an_int4_base_equal_peft_over_its_dequantized_weights(algorithm, tiny_checkpoints,
                                                                             tmp_path_factory, tmp_path):
    import torch
    from shared_builds import build_reusing_export
    from transformers import AutoModelForCausalLM

    from llmc.compiler.lora import add_lora_branches, find_sites, read_adapter, step_inputs
    from llmc.compiler.lora.fold import Fold
    from llmc.compiler.quantize.channel_scales import FILENAME, ChannelScales
    from llmc.compiler.spec import parse_spec

    checkpoint = tiny_checkpoints["llama"]
    spec = parse_spec({"name": "q", "source": str(checkpoint),
                       "quantization": {"mode": "int4-weight-only", "algorithm": algorithm}})
    exported = build_reusing_export(tmp_path_factory, spec, tmp_path / "q", until="quantize").exported
    hf = AutoModelForCausalLM.from_pretrained(checkpoint)
    sites = find_sites(onnx.load(str(tmp_path / "q" / "export" / exported.onnx)), hf)
    scales = ChannelScales.load(tmp_path / "q" / "quantize" / FILENAME) if algorithm == "awq" else ChannelScales()
    assert bool(scales) == (algorithm == "awq")
    fold = Fold.of(sites, scales)

    model = onnx.load(str(tmp_path / "q" / "quantize" / "model.onnx"))
    nbits = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    for node in nbits:  # fp32 activations: ONNX Runtime dequantizes the codes and runs an fp32 GEMM
        next(a for a in node.attribute if a.name == "accuracy_level").i = 0
    exact = tmp_path / "exact.onnx"
    onnx.save(model, str(exact))

    # the checkpoint's model with the served weights in its own coordinates (the LM head is a site: untied)
    served = {}
    for site in sites:
        w, bias = served_map(exact, site.x, site.y, site.in_features)
        if site.name in fold.a_rows:
            w = w / fold.a_rows[site.name][:, None]
        if site.name in fold.b_columns:
            w, bias = w / fold.b_columns[site.name], bias / fold.b_columns[site.name]
        served.update({m.module: (w[:, m.offset:m.offset + m.width], bias[m.offset:m.offset + m.width])
                       for m in site.members})
    assert "lm_head" in served and len(served) == 2 * 7 + 1
    paths = dict(zip("ab", family_adapters("llama", checkpoint, tmp_path)))
    peft = peft_model(checkpoint, paths, base=hf)
    # after PEFT's loads: adapter A's copy of the head's weight (the checkpoint's, fp32) went in place of the base's
    with torch.no_grad():
        for name, (w, bias) in served.items():
            module = peft.base_model.model.get_submodule(name)
            module = getattr(module, "base_layer", module)
            module.weight.copy_(torch.from_numpy(w.T.copy()))
            if module.bias is not None:
                module.bias.copy_(torch.from_numpy(bias.copy()))
    want = model_logits(peft, [(PROMPT, "a"), (PROMPT, "b"), (PROMPT, None)])

    add_lora_branches(model, sites)
    onnx.save(model, str(tmp_path / "exact_lora.onnx"))
    adapters = [read_adapter(name, path, max_rank=16) for name, path in paths.items()]
    rows = [(len(PROMPT), 0), (len(PROMPT), 1), (len(PROMPT), -1)]
    got = PagedSteps(tmp_path / "exact_lora.onnx", exported.kv_layout).step(
        [(r, PROMPT) for r in range(3)], step_inputs(sites, adapters, rows, fold))
    for r, label in enumerate(("adapter a", "adapter b", "the base")):
        assert np.abs(got[r] - want[r]).max() < TOL, f"{label}: logits differ from PEFT's over the dequantized weights"
    assert np.abs(got[0] - got[2]).max() > 0.5 and np.abs(got[1] - got[2]).max() > 0.5
